"""Mutators of an HF checkpoint directory: config.json (fields, rope_scaling, the JSON itself),
model.safetensors (its header as JSON, the length prefix, the bytes), the shard index, and the
tokenizer's two files. Each takes (rng, corpus, out), writes a mutated copy of an original at
`out` and returns a one-line description of what it changed."""
import json
import math
import os
import shutil
import struct

from . import values

CONFIG_KEYS_ABSENT = ("rope_scaling", "hidden_act", "mlp_bias", "use_sliding_window",
                      "pretraining_tp", "sliding_window", "num_key_value_heads", "torch_dtype",
                      "quantization_config", "rope_type", "head_dim")


def _copy(corpus, out, sharded=False):
    shutil.copytree(corpus.sharded_dir() if sharded else corpus.hf_dir(), out)
    return out


def _read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path, value):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f)  # allow_nan: NaN and Infinity as Python's json (and HF's) read them


def _write_text(path, text):
    with open(path, "wb") as f:
        f.write(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)


# ---------------------------------------------------------------- config.json

def config_field(rng, corpus, out):
    _copy(corpus, out)
    path = os.path.join(out, "config.json")
    d = _read_json(path)
    key = rng.choice(sorted(d) + list(CONFIG_KEYS_ABSENT))
    if key in d and rng.random() < 0.2:
        del d[key]
        detail = f"config.json: deleted {key!r}"
    else:
        value = values.swap(rng, d.get(key))
        d[key] = value
        detail = f"config.json: {key} = {_short(value)}"
    _write_json(path, d)
    return detail


def _rope_scalings(rng):
    good_linear = {"rope_type": "linear", "factor": rng.choice((2.0, 4.0, 0.5, 8))}
    good_llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    odd = values.swap(rng, 4.0)
    return [
        good_linear, good_llama3,
        {"type": "linear", "factor": 2.0},                                  # the old key
        {"type": "llama3", **{k: v for k, v in good_llama3.items() if k != "rope_type"}},
        {"rope_type": "linear", "type": "yarn", "factor": 2.0},
        {"rope_type": "default"}, {"rope_type": "default", "factor": 4.0}, {}, {"factor": 4.0},
        {"rope_type": "linear"}, {"rope_type": "linear", "factor": odd},
        {"rope_type": "linear", "factor": math.inf}, {"rope_type": "linear", "factor": True},
        {"rope_type": "linear", "factor": "2.0"}, {"rope_type": "linear", "factor": -2.0},
        {"rope_type": "llama3", **{k: v for k, v in good_llama3.items()
                                   if k not in ("rope_type", rng.choice(list(good_llama3)))}},
        {**good_llama3, "original_max_position_embeddings": rng.choice((64.5, "64", 2**63, 0,
                                                                         True))},
        {**good_llama3, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
        {**good_llama3, rng.choice(("factor", "low_freq_factor", "high_freq_factor")): odd},
        {"rope_type": rng.choice(("dynamic", "yarn", "longrope", "su", "ntk", "", "LINEAR", 1,
                                  None, ["linear"]))},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {**good_linear, "garbage": values.nested(5)},
        values.swap(rng, None), "linear", 4.0, ["linear", 4.0], True, values.nested_dict(40),
    ]


def config_rope_scaling(rng, corpus, out):
    _copy(corpus, out)
    path = os.path.join(out, "config.json")
    d = _read_json(path)
    d["rope_scaling"] = rng.choice(_rope_scalings(rng))
    _write_json(path, d)
    return f"config.json: rope_scaling = {_short(d['rope_scaling'])}"


def config_document(rng, corpus, out):
    """The JSON document itself: nesting, other top-level types, bad bytes, absence."""
    _copy(corpus, out)
    path = os.path.join(out, "config.json")
    text = open(path, encoding="utf-8").read()
    depth = rng.choice((100, 1000, 100_000))
    choices = {
        "nested array": lambda: "[" * depth + "]" * depth,
        "nested value": lambda: text.rstrip()[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}",
        "nested object": lambda: '{"a":' * depth + "1" + "}" * depth,
        "top-level list": lambda: "[" + text + "]",
        "top-level string": lambda: json.dumps(text),
        "top-level number": lambda: "64",
        "null": lambda: "null",
        "empty": lambda: "",
        "truncated": lambda: text[:rng.randrange(len(text))],
        "invalid utf-8": lambda: text.encode()[:20] + b"\xff\xfe" + text.encode()[20:],
        "bom": lambda: "\ufeff" + text,
        "duplicate key": lambda: text.rstrip()[:-1] + ', "hidden_size": 128}',
        "trailing garbage": lambda: text + "}{",
        "missing": None,
        "a directory": None,
    }
    kind = rng.choice(sorted(choices))
    if kind == "missing":
        os.remove(path)
    elif kind == "a directory":
        os.remove(path)
        os.mkdir(path)
    else:
        _write_text(path, choices[kind]())
    return f"config.json: {kind}" + (f" (depth {depth})" if "nested" in kind else "")


# ---------------------------------------------------------------- model.safetensors

def _header(path):
    data = open(path, "rb").read()
    n = struct.unpack_from("<Q", data)[0]
    return data, json.loads(data[8:8 + n]), n


def _with_header(data, n, header):
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + data[8 + n:]


def safetensors_header(rng, corpus, out):
    _copy(corpus, out)
    path = os.path.join(out, "model.safetensors")
    data, header, n = _header(path)
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    kind = rng.choice(("dtype", "shape", "offsets", "rename", "delete", "duplicate shape",
                       "extra tensor", "metadata", "entry type", "swap offsets"))
    if kind == "dtype":
        entry["dtype"] = rng.choice(("F16", "BF16", "F64", "I32", "U8", "BOOL", "F8_E4M3", "f32",
                                     "", None, 4, ["F32"]))
        detail = f"dtype {entry['dtype']!r}"
    elif kind == "shape":
        shape = list(entry["shape"])
        choice = rng.choice(("extra row", "transposed", "0-dim", "flat", "negative", "huge",
                             "float", "string", "zero", "extra dim", "null"))
        shape = {"extra row": lambda: [shape[0] + 1] + shape[1:],
                 "transposed": lambda: shape[::-1],
                 "0-dim": lambda: [],
                 "flat": lambda: [math.prod(shape)],
                 "negative": lambda: [-shape[0]] + shape[1:],
                 "huge": lambda: [2**62, 2**62][:len(shape)],
                 "float": lambda: [float(s) for s in shape],
                 "string": lambda: [str(s) for s in shape],
                 "zero": lambda: [0] + shape[1:],
                 "extra dim": lambda: shape + [1],
                 "null": lambda: None}[choice]()
        entry["shape"] = shape
        detail = f"shape {choice}: {_short(shape)}"
    elif kind == "offsets":
        b, e = entry["data_offsets"]
        entry["data_offsets"] = rng.choice(([b, e + 4], [b + 4, e], [b - 4, e - 4], [e, b],
                                            [b, 2**64 - 1], [-1, e], [b, e * 1000], [b],
                                            [float(b), float(e)], None, [str(b), str(e)],
                                            [2**63, 2**63 + e - b]))
        detail = f"data_offsets {_short(entry['data_offsets'])} (was {[b, e]})"
    elif kind == "swap offsets":
        other = header[rng.choice(names)]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
        detail = "two tensors' data_offsets swapped"
    elif kind == "rename":
        header[rng.choice(("model.layers.9.mlp.up_proj.weight", name + "x",
                           "model.layers.0.self_attn.o_proj.bias", ""))] = header.pop(name)
        detail = "renamed"
    elif kind == "delete":
        del header[name]
        detail = "deleted"
    elif kind == "duplicate shape":
        other = rng.choice(names)
        entry["shape"] = header[other]["shape"]
        detail = f"shape of {other}"
    elif kind == "extra tensor":
        header["model.layers.0.self_attn.q_norm.weight"] = dict(entry)
        detail = "an extra tensor aliasing this one's bytes"
    elif kind == "metadata":
        header["__metadata__"] = values.swap(rng, {"format": "pt"})
        detail = f"__metadata__ = {_short(header['__metadata__'])}"
    else:
        header[name] = values.swap(rng, entry)
        detail = f"entry = {_short(header[name])}"
    _write_text(path, _with_header(data, n, header))
    return f"model.safetensors: {name}: {kind}: {detail}"


def safetensors_bytes(rng, corpus, out):
    _copy(corpus, out)
    path = os.path.join(out, "model.safetensors")
    data = bytearray(open(path, "rb").read())
    n = struct.unpack_from("<Q", data)[0]
    kind = rng.choice(("truncate", "truncate header", "flip header", "flip data", "length",
                       "append", "empty", "header not json"))
    if kind == "truncate":
        cut = rng.randrange(len(data))
        data = data[:cut]
        detail = f"truncated to {cut} bytes"
    elif kind == "truncate header":
        cut = rng.randrange(8 + n)
        data = data[:cut]
        detail = f"truncated to {cut} bytes (inside the header)"
    elif kind in ("flip header", "flip data"):
        lo, hi = (8, 8 + n) if kind == "flip header" else (8 + n, len(data))
        at = [rng.randrange(lo, hi) for _ in range(rng.choice((1, 1, 4)))]
        for i in at:
            data[i] ^= 1 << rng.randrange(8)
        detail = f"bits flipped at {at}"
    elif kind == "length":
        value = rng.choice((0, 1, n - 1, n + 1, n + 8, len(data), 2**63, 2**64 - 1, 100_000_001))
        struct.pack_into("<Q", data, 0, value)
        detail = f"header length {value} (was {n})"
    elif kind == "append":
        data += bytes(rng.randrange(256) for _ in range(rng.choice((1, 4, 4096))))
        detail = "bytes appended"
    elif kind == "empty":
        data = bytearray()
        detail = "empty file"
    else:
        blob = rng.choice((b"[" * 10000 + b"]" * 10000, b"not json", b"\xff" * 16, b"[]",
                           b'{"a": ' * 5000 + b"1" + b"}" * 5000))
        blob += b" " * (-len(blob) % 8)
        data = bytearray(struct.pack("<Q", len(blob)) + blob + bytes(data[8 + n:]))
        detail = f"header {blob[:12]!r}..."
    _write_text(path, bytes(data))
    return f"model.safetensors: {kind}: {detail}"


def safetensors_index(rng, corpus, out):
    _copy(corpus, out, sharded=True)
    path = os.path.join(out, "model.safetensors.index.json")
    index = _read_json(path)
    wm = index["weight_map"]
    names, files = sorted(wm), sorted(set(wm.values()))
    name = rng.choice(names)
    kind = rng.choice(("missing file", "traversal", "absolute", "wrong shard", "drop entry",
                       "extra entry", "weight_map type", "entry type", "index type", "nested",
                       "not json", "drop shard file"))
    if kind == "missing file":
        wm[name] = "model-00009-of-00009.safetensors"
    elif kind == "traversal":
        wm[name] = "../" + wm[name]
    elif kind == "absolute":
        wm[name] = os.path.abspath(os.path.join(out, wm[name]))
    elif kind == "wrong shard":
        wm[name] = rng.choice([f for f in files if f != wm[name]] or files)
    elif kind == "drop entry":
        del wm[name]
    elif kind == "extra entry":
        wm["model.layers.7.mlp.gate_proj.weight"] = files[0]
    elif kind == "weight_map type":
        index["weight_map"] = values.swap(rng, None)
    elif kind == "entry type":
        wm[name] = values.swap(rng, wm[name])
    elif kind == "index type":
        index = values.swap(rng, None)
    elif kind == "drop shard file":
        os.remove(os.path.join(out, rng.choice(files)))
    if kind == "not json":
        _write_text(path, "{weight_map: ")
    elif kind == "nested":
        depth = rng.choice((100, 5000))
        _write_text(path, '{"weight_map":' + '{"a":' * depth + "1" + "}" * (depth + 1))
    else:
        _write_json(path, index)
    return f"model.safetensors.index.json: {kind} ({name})"


# ---------------------------------------------------------------- tokenizer files

def tokenizer_json(rng, corpus, out):
    _copy(corpus, out)
    path = os.path.join(out, "tokenizer.json")
    text = open(path, encoding="utf-8").read()
    d = json.loads(text)
    model = d["model"]
    vocab, merges = model["vocab"], model["merges"]
    kind = rng.choice(("merge of unknown tokens", "vocab entry removed", "duplicate ids",
                       "huge id", "negative id", "merges type", "vocab type", "model type",
                       "added token id", "pre_tokenizer", "truncated", "nested", "empty vocab",
                       "merge not a pair"))
    if kind == "merge of unknown tokens":
        merges.append(["zzqq", "qqzz"] if isinstance(merges[0], list) else "zzqq qqzz")
    elif kind == "vocab entry removed":
        merged = merges[rng.randrange(len(merges))]
        piece = "".join(merged) if isinstance(merged, list) else merged.replace(" ", "")
        vocab.pop(piece, None)
        vocab.pop(rng.choice(sorted(vocab)))
    elif kind == "duplicate ids":
        a, b = rng.sample(sorted(vocab), 2)
        vocab[a] = vocab[b]
    elif kind == "huge id":
        vocab[rng.choice(sorted(vocab))] = rng.choice(values.HUGE_INTS)
    elif kind == "negative id":
        vocab[rng.choice(sorted(vocab))] = rng.choice(values.NEGATIVE_INTS)
    elif kind == "merges type":
        model["merges"] = values.swap(rng, None)
    elif kind == "vocab type":
        model["vocab"] = values.swap(rng, None)
    elif kind == "model type":
        model["type"] = rng.choice(("WordPiece", "Unigram", "bpe", "", None, 3))
    elif kind == "added token id":
        d["added_tokens"][rng.randrange(len(d["added_tokens"]))]["id"] = rng.choice(
            (2**32, -1, 5, 299, 300, 10**6, "297", None))
    elif kind == "pre_tokenizer":
        d["pre_tokenizer"] = rng.choice(({"type": "Nope"}, None, [], {"type": "Split"},
                                         values.nested_dict(50)))
    elif kind == "empty vocab":
        model["vocab"] = {}
    elif kind == "merge not a pair":
        merges[rng.randrange(len(merges))] = rng.choice((["a"], "abc", ["a", "b", "c"], 5, None))
    if kind == "truncated":
        _write_text(path, text[:rng.randrange(len(text))])
    elif kind == "nested":
        _write_text(path, "[" * 100_000 + "]" * 100_000)
    else:
        _write_json(path, d)
    return f"tokenizer.json: {kind}"


TEMPLATES = (
    "{% for m in messages %}{{ m['content'] }",                          # syntax error
    "{% for %}", "{{", "{% endfor %}", "{% if %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",                    # forbidden attributes
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ raise_exception('no') }}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{{ j }}{% endfor %}{% endfor %}",
    "{{ 'x' * 3000000000 }}",                                            # huge output
    "{{ 'x' * 100000000 }}",
    "{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = ns.x + ns.x %}"
    "{% endfor %}{{ ns.x|length }}",
    "{{ messages[99] }}", "{{ messages[0]['nope'] }}", "{{ undefined_name.attr }}",
    "{{ 1 / 0 }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{{ bos_token }}{{ messages|tojson }}", "",
)


def tokenizer_config(rng, corpus, out):
    _copy(corpus, out)
    path = os.path.join(out, "tokenizer_config.json")
    d = _read_json(path)
    kind = rng.choice(("chat_template", "chat_template", "chat_template type", "bos_token",
                       "eos_token", "add_bos_token", "document"))
    if kind == "chat_template":
        d["chat_template"] = rng.choice(TEMPLATES)
    elif kind == "chat_template type":
        d["chat_template"] = rng.choice((values.swap(rng, d["chat_template"]),
                                         [{"name": "default", "template": d["chat_template"]}],
                                         [{"name": "tool_use", "template": "{{ x }}"}]))
    elif kind in ("bos_token", "eos_token"):
        d[kind] = rng.choice((values.swap(rng, d.get(kind)), "<|not-a-token|>", {"content": 5},
                              {"nope": 1}, "<|im_start|>", 297))
    elif kind == "add_bos_token":
        d[kind] = values.swap(rng, False)
    key = "chat_template" if kind == "chat_template type" else kind
    detail = f"{key} = {_short(d.get(key))}" if kind != "document" else ""
    if kind == "document":
        doc = rng.choice(("[]", '"x"', "null", "{", "[" * 50000 + "]" * 50000, "\xff"))
        _write_text(path, doc)
        detail = f"document {doc[:8]!r}"
    else:
        _write_json(path, d)
    return f"tokenizer_config.json: {detail}"


def _short(value, n=70):
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= n else text[:n] + f"... ({len(text)} chars)"
