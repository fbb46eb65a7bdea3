"""Mutators of a GGUF file: its metadata retyped or out of range (written again by the gguf
package's writer, so the file is well formed and only the values are odd), its tensors
described wrongly, and its bytes edited in place (header counts, lengths, tensor infos,
truncation, bit flips). Each takes (rng, corpus, out), writes the file `out` and returns
(description, tensors_intact): whether the file still holds the originals' weights."""
import math
import struct

from . import gguf_layout, values
from .corpus import write_gguf

ARCH = "llama"
COUNTS = ("block_count", "context_length", "embedding_length", "feed_forward_length",
          "attention.head_count", "attention.head_count_kv", "attention.key_length",
          "rope.dimension_count")
FLOATS = ("attention.layer_norm_rms_epsilon", "rope.freq_base")


def _types():
    from gguf import GGUFValueType as T
    return T


def _retyped(rng, value):
    """(vtype, value, sub_type) of another GGUF type holding about the same value."""
    T = _types()
    number = value if isinstance(value, (int, float)) else 1
    kinds = [
        (T.FLOAT32, float(number), None), (T.FLOAT64, float(number) + 0.5, None),
        (T.STRING, str(value), None), (T.BOOL, bool(number), None),
        (T.ARRAY, [number], T.UINT32 if isinstance(number, int) and number >= 0 else T.FLOAT32),
        (T.ARRAY, [0], T.UINT32), (T.INT32, -abs(int(number)) if math.isfinite(number) else -1,
                                  None),
        (T.UINT64, int(number) if math.isfinite(number) else 0, None),
        (T.UINT8, int(number) % 256 if math.isfinite(number) else 0, None),
    ]
    return rng.choice(kinds)


def _odd_value(rng, key):
    """An out-of-range value of the key's own kind, or one of the issue's named cases."""
    T = _types()
    named = {
        "block_count": [(T.UINT32, 2**32 - 1), (T.UINT32, 0), (T.UINT64, 2**40)],
        "attention.head_count": [(T.FLOAT32, 1e-40), (T.UINT32, 0), (T.UINT32, 3),
                                 (T.UINT32, 2**32 - 1)],
        "attention.head_count_kv": [(T.FLOAT32, 1.5), (T.UINT32, 3), (T.UINT32, 0),
                                    (T.UINT32, 8)],
        "context_length": [(T.UINT64, 2**62), (T.UINT32, 0), (T.UINT32, 1), (T.FLOAT32, 256.7),
                           (T.UINT64, 2**64 - 1)],
        "rope.dimension_count": [(T.UINT32, 8), (T.UINT32, 0), (T.UINT32, 2**31),
                                 (T.STRING, "16"), (T.FLOAT32, 16.5), (T.UINT32, 32)],
        "attention.layer_norm_rms_epsilon": [(T.FLOAT32, math.nan), (T.FLOAT32, 0.0),
                                             (T.FLOAT32, -1e-5), (T.FLOAT32, math.inf),
                                             (T.FLOAT64, 1e-300)],
        "rope.freq_base": [(T.FLOAT32, math.nan), (T.FLOAT32, -10000.0), (T.FLOAT32, 0.0),
                           (T.FLOAT32, math.inf), (T.FLOAT32, 1e-30)],
    }
    generic = [(T.UINT32, 2**32 - 1), (T.UINT64, 2**63), (T.INT32, -1), (T.UINT32, 0),
               (T.UINT32, 1), (T.INT64, -(2**63))]
    vtype, value = rng.choice(named.get(key, []) + generic)
    return vtype, value, None


def gguf_metadata(rng, corpus, out):
    T = _types()
    spec = corpus.gguf_spec()
    kind = rng.choice(("retype", "odd value", "odd value", "delete", "rope scaling",
                       "architecture", "extra key"))
    if kind in ("retype", "odd value", "delete"):
        short = rng.choice(COUNTS + FLOATS)
        key = f"{ARCH}.{short}"
        i = spec.index(key)
        if kind == "delete":
            del spec.kv[i]
            detail = f"deleted {key}"
        else:
            _, _, value, _ = spec.kv[i]
            vtype, new, sub = _retyped(rng, value) if kind == "retype" else _odd_value(rng, short)
            spec.kv[i] = (key, vtype, new, sub)
            detail = f"{key} = {vtype.name} {new!r}"
    elif kind == "rope scaling":
        adds = rng.choice((
            [("rope.scaling.type", T.STRING, "linear"), ("rope.scaling.factor", T.FLOAT32, 4.0)],
            [("rope.scaling.factor", T.FLOAT32, 2.0)],
            [("rope.scaling.type", T.STRING, "yarn"), ("rope.scaling.factor", T.FLOAT32, 4.0),
             ("rope.scaling.original_context_length", T.UINT32, 64)],
            [("rope.scaling.type", T.STRING, "none")],
            [("rope.scaling.type", T.STRING, "linear"), ("rope.scaling.factor", T.FLOAT32,
                                                         rng.choice((math.nan, -1.0, 0.0,
                                                                     math.inf)))],
            [("rope.scaling.type", T.UINT32, 1)],
            [("rope.scaling.type", T.STRING, "garbage")],
            [("rope.scale_linear", T.FLOAT32, 4.0)],
            [("rope.scaling.finetuned", T.BOOL, True)],
            [("rope.scaling.attn_factor", T.FLOAT32, 0.5)],
        ))
        for short, vtype, value in adds:
            spec.kv.append((f"{ARCH}.{short}", vtype, value, None))
        detail = ", ".join(f"{ARCH}.{s} = {v!r}" for s, _, v in adds)
    elif kind == "architecture":
        arch = rng.choice(("qwen2", "gpt2", "mistral", "", "LLAMA"))
        spec.arch = arch
        detail = f"general.architecture = {arch!r} (keys still {ARCH}.*)"
    else:
        extra = rng.choice(((f"{ARCH}.attention.value_length", T.UINT32, 8),
                            (f"{ARCH}.vocab_size", T.UINT32, 301),
                            (f"{ARCH}.vocab_size", T.UINT32, 2**32 - 1),
                            (f"{ARCH}.expert_count", T.UINT32, 4),
                            (f"{ARCH}.attention.sliding_window", T.UINT32, 16),
                            ("general.alignment", T.UINT32, 7)))
        spec.kv.append((*extra, None))
        detail = f"added {extra[0]} = {extra[2]!r}"
    write_gguf(out, spec)
    # a declared alignment the writer did not use moves where the file says the data is
    return f"metadata: {detail}", "general.alignment" not in detail


def gguf_tokenizer(rng, corpus, out):
    T = _types()
    spec = corpus.gguf_spec()
    kind = rng.choice(("tokens truncated", "token_type length", "merge without space",
                       "merge unknown", "merges type", "bos out of range", "eos type", "model",
                       "pre", "chat_template", "tokens type", "add_bos_token", "duplicate token"))
    items = {k: (i, v) for i, (k, _, v, _) in enumerate(spec.kv)}

    def put(key, vtype, value, sub=None):
        if key in items:
            spec.kv[items[key][0]] = (key, vtype, value, sub)
        else:
            spec.kv.append((key, vtype, value, sub))

    tokens = items["tokenizer.ggml.tokens"][1]
    merges = items["tokenizer.ggml.merges"][1]
    if kind == "tokens truncated":
        put("tokenizer.ggml.tokens", T.ARRAY, tokens[:rng.choice((1, 2, 100, 299))], T.STRING)
    elif kind == "token_type length":
        put("tokenizer.ggml.token_type", T.ARRAY, [1] * rng.choice((1, 5, 301, 1000)), T.INT32)
    elif kind == "merge without space":
        put("tokenizer.ggml.merges", T.ARRAY, merges[:3] + ["abc"] + merges[3:], T.STRING)
    elif kind == "merge unknown":
        put("tokenizer.ggml.merges", T.ARRAY, merges + ["zzqq qqzz", " ", "a b c"], T.STRING)
    elif kind == "merges type":
        put("tokenizer.ggml.merges", T.ARRAY, [1, 2, 3], T.UINT32)
    elif kind == "bos out of range":
        put("tokenizer.ggml.bos_token_id", T.UINT32, rng.choice((300, 2**32 - 1, 10**6)))
    elif kind == "eos type":
        put("tokenizer.ggml.eos_token_id", *rng.choice(((T.FLOAT32, 299.0), (T.STRING, "299"),
                                                        (T.INT32, -1), (T.BOOL, True))))
    elif kind == "model":
        put("tokenizer.ggml.model", T.STRING, rng.choice(("llama", "bert", "", "gpt2 ")))
    elif kind == "pre":
        put("tokenizer.ggml.pre", T.STRING, rng.choice(("qwen2", "smollm", "nope", "")))
    elif kind == "chat_template":
        from .hf_mutators import TEMPLATES
        put("tokenizer.chat_template", T.STRING, rng.choice(TEMPLATES))
    elif kind == "tokens type":
        put("tokenizer.ggml.tokens", T.ARRAY, list(range(300)), T.UINT32)
    elif kind == "add_bos_token":
        put("tokenizer.ggml.add_bos_token", *rng.choice(((T.BOOL, True), (T.STRING, "false"),
                                                         (T.UINT32, 0), (T.UINT32, 2))))
    else:
        put("tokenizer.ggml.tokens", T.ARRAY, tokens[:5] + [tokens[4]] + tokens[6:], T.STRING)
    write_gguf(out, spec)
    return f"tokenizer: {kind}", True


def gguf_tensors(rng, corpus, out):
    """Tensor descriptions that disagree with the model: written through the writer."""
    import numpy as np
    spec = corpus.gguf_spec()
    i = rng.randrange(len(spec.tensors))
    name, array = spec.tensors[i][:2]
    kind = rng.choice(("extra rows", "missing", "unknown name", "rope_freqs",
                       "f16", "transposed", "0-dim", "bf16 raw"))
    intact = False
    if kind == "extra rows":
        spec.tensors[i] = (name, np.concatenate([array, array[:1]]) if array.ndim else array)
    elif kind == "missing":
        del spec.tensors[i]
    elif kind == "unknown name":
        spec.tensors.append(("blk.0.attn_q_norm.weight", array[:16].copy()))
    elif kind == "rope_freqs":
        factors = rng.choice((np.full(8, 4.0, np.float32), np.ones(8, np.float32),
                              np.linspace(1, 8, 8, dtype=np.float32)))
        spec.tensors.append(("rope_freqs.weight", factors))
        kind += f" {factors.tolist()}"
        intact = True
    elif kind == "f16":
        spec.tensors[i] = (name, array.astype(np.float16))
    elif kind == "transposed":
        spec.tensors[i] = (name, np.ascontiguousarray(array.T))
    elif kind == "0-dim":
        spec.tensors[i] = (name, np.asarray(array.reshape(-1)[0]))
    else:
        from gguf import GGMLQuantizationType as Q
        raw = array.view(np.uint8)
        spec.tensors[i] = (name, raw, (array.shape[0], array.shape[-1] * 2) if array.ndim == 2
                           else (array.shape[0] * 2,), Q.BF16)
    write_gguf(out, spec)
    return f"tensor {name}: {kind}", intact


def gguf_bytes(rng, corpus, out):
    """Byte-level edits of the written original, at places the layout names."""
    base = corpus.gguf_file()
    data = bytearray(open(base, "rb").read())
    lay = gguf_layout.walk(bytes(data))
    kind = rng.choice(("truncate header", "truncate", "flip", "version", "n_tensors", "n_kv",
                       "key length", "string length", "array count", "value type", "n_dims",
                       "dim", "tensor type", "offset", "magic"))
    if kind == "truncate header":
        cut = rng.randrange(lay.header_end)
        data = data[:cut]
        detail = f"cut at {cut} of a {lay.header_end}-byte header"
    elif kind == "truncate":
        cut = rng.randrange(lay.data_start, len(data))
        data = data[:cut]
        detail = f"cut at {cut} of {len(data)}"
    elif kind == "flip":
        at = [rng.randrange(len(data)) for _ in range(rng.choice((1, 2, 8)))]
        for j in at:
            data[j] ^= 1 << rng.randrange(8)
        detail = f"bits flipped at {at}"
    elif kind == "magic":
        data[:4] = rng.choice((b"GGUX", b"FUGG", b"\0\0\0\0"))
        detail = f"magic {bytes(data[:4])!r}"
    elif kind in ("version", "n_tensors", "n_kv"):
        at, fmt = {"version": (4, "<I"), "n_tensors": (lay.n_tensors_at, "<Q"),
                   "n_kv": (lay.n_kv_at, "<Q")}[kind]
        value = rng.choice((0, 1, 2, 4, 2**31, 2**32 - 1) if fmt == "<I"
                           else (0, 1, len(lay.tensors) + 1, 2**32, 2**63, 2**64 - 1))
        struct.pack_into(fmt, data, at, value)
        detail = f"= {value}"
    elif kind in ("key length", "string length", "array count", "value type"):
        kv = rng.choice(lay.kvs)
        if kind == "key length":
            value = rng.choice((0, 2**16, 2**63, 2**64 - 1, len(kv.key) + 1))
            struct.pack_into("<Q", data, kv.at, value)
        elif kind == "value type":
            value = rng.choice((13, 99, 2**32 - 1, 8, 9, 0, 12))
            struct.pack_into("<I", data, kv.type_at, value)
        else:
            vtype = struct.unpack_from("<I", data, kv.type_at)[0]
            value = rng.choice((2**63, 2**40, 0, 2**64 - 1))
            if vtype == gguf_layout.STRING:
                struct.pack_into("<Q", data, kv.value_at, value)
            elif vtype == gguf_layout.ARRAY:
                struct.pack_into("<Q", data, kv.value_at + 4, value)
            else:
                struct.pack_into("<I", data, kv.type_at, gguf_layout.STRING)
        detail = f"{kv.key}: {value}"
    else:
        t = rng.choice(lay.tensors)
        if kind == "n_dims":
            value = rng.choice((0, 3, 5, 2**31, 2**32 - 1))
            struct.pack_into("<I", data, t.ndims_at, value)
        elif kind == "dim":
            value = rng.choice((0, 1, 2**32, 2**62, 2**64 - 1, 65, 63))
            struct.pack_into("<Q", data, t.dims_at + 8 * rng.randrange(t.n_dims), value)
        elif kind == "tensor type":
            value = rng.choice((1, 2, 8, 30, 39, 99, 2**32 - 1, 12, 3))
            struct.pack_into("<I", data, t.type_at, value)
        else:
            old = struct.unpack_from("<Q", data, t.offset_at)[0]
            value = rng.choice((len(data), len(data) * 4, 2**63, 2**64 - 32, old + 1, old + 32,
                                0))
            struct.pack_into("<Q", data, t.offset_at, value)
        detail = f"{t.name}: {value}"
    with open(out, "wb") as f:
        f.write(bytes(data))
    return f"bytes: {kind}: {detail}", False
