"""The valid originals every mutant starts from: one tiny model (2 layers, hidden 64, vocab 300)
with a small byte-level BPE tokenizer and a ChatML template, written as an HF checkpoint
directory (as gyges.Model.save writes it, plus tokenizer.json and tokenizer_config.json), as a
sharded one (model.safetensors.index.json) and as a GGUF file (the `gguf` package's writer, q/k
rows permuted as llama.cpp's converter does). Built once per process, deterministically, so a
mutant is the same bytes on every run."""
import json
import os
import shutil
from dataclasses import dataclass, field

import numpy as np

import gyges
from gyges.models import gguf_file
from gyges.models.config import ModelConfig
from tests.gguf_writer import gguf_tensors

MODEL_SEED = 7
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB = 300
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = (" the", " of", " and", " to", " in", " is", "Hello", " world", " capital", " France",
         "ing", " Paris", " model", " user", "assistant", " hi")


def config():
    n_normal = VOCAB - len(SPECIALS)
    return ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=256, tie_word_embeddings=False,
                       bos_token_id=n_normal, eos_token_id=n_normal + 2)


def bpe_vocab():
    """(tokens in id order, merges as "a b"): the 256 byte-level symbols, merges that spell
    WORDS, then the special tokens, VOCAB in all."""
    from tokenizers import pre_tokenizers
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_char = {c: c for c in tokens}
    space = [c for c in tokens if ord(c) == 0x120][0]  # byte-level "Ġ" is a space
    known, merges = set(tokens), []
    for word in WORDS:
        symbols = [space if ch == " " else byte_char.get(ch, ch) for ch in word]
        left = symbols[0]
        for right in symbols[1:]:
            merged = left + right
            if merged not in known and len(tokens) < VOCAB - len(SPECIALS):
                tokens.append(merged)
                known.add(merged)
                merges.append(f"{left} {right}")
            if merged not in known:
                break
            left = merged
    while len(tokens) < VOCAB - len(SPECIALS):  # pad with unreachable but valid tokens
        tokens.append(f"<unused{len(tokens)}>")
    return tokens + list(SPECIALS), merges


def tokenizer_json():
    """tokenizer.json text of the BPE above (the `tokenizers` library's own serialisation)."""
    import tokenizers as t
    tokens, merges = bpe_vocab()
    vocab = {tok: i for i, tok in enumerate(tokens[:-len(SPECIALS)])}
    backend = t.Tokenizer(t.models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                                       fuse_unk=False))
    backend.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = t.decoders.ByteLevel()
    backend.add_special_tokens([t.AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return backend.to_str()


def tokenizer_config():
    return {"chat_template": CHAT_TEMPLATE, "bos_token": SPECIALS[0],
            "eos_token": {"content": SPECIALS[2]}, "add_bos_token": False}


@dataclass
class GGUFSpec:
    """A GGUF file before it is written: arch, metadata [(key, GGUFValueType, value, sub_type)],
    tensors [(gguf name, float32 array)]. Mutators edit this, then write it."""
    arch: str
    kv: list = field(default_factory=list)
    tensors: list = field(default_factory=list)

    def copy(self):
        return GGUFSpec(self.arch, list(self.kv), list(self.tensors))

    def index(self, key):
        return next((i for i, item in enumerate(self.kv) if item[0] == key), None)


def gguf_spec(model):
    from gguf import GGUFValueType as T
    c = model.config
    tokens, merges = bpe_vocab()
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    a = "llama"
    kv = [(f"{a}.block_count", T.UINT32, c.num_hidden_layers, None),
          (f"{a}.context_length", T.UINT32, c.max_position_embeddings, None),
          (f"{a}.embedding_length", T.UINT32, c.hidden_size, None),
          (f"{a}.feed_forward_length", T.UINT32, c.intermediate_size, None),
          (f"{a}.attention.head_count", T.UINT32, c.num_attention_heads, None),
          (f"{a}.attention.head_count_kv", T.UINT32, c.num_key_value_heads, None),
          (f"{a}.attention.key_length", T.UINT32, c.head_dim, None),
          (f"{a}.attention.layer_norm_rms_epsilon", T.FLOAT32, c.rms_norm_eps, None),
          (f"{a}.rope.freq_base", T.FLOAT32, c.rope_theta, None),
          (f"{a}.rope.dimension_count", T.UINT32, c.head_dim, None),
          ("tokenizer.ggml.model", T.STRING, "gpt2", None),
          ("tokenizer.ggml.pre", T.STRING, "gpt2", None),
          ("tokenizer.ggml.tokens", T.ARRAY, tokens, T.STRING),
          ("tokenizer.ggml.token_type", T.ARRAY, types, T.INT32),
          ("tokenizer.ggml.merges", T.ARRAY, merges, T.STRING),
          ("tokenizer.ggml.bos_token_id", T.UINT32, c.bos_token_id, None),
          ("tokenizer.ggml.eos_token_id", T.UINT32, c.eos_tokens()[0], None),
          ("tokenizer.chat_template", T.STRING, CHAT_TEMPLATE, None)]
    tensors = list(gguf_tensors(model).items())
    return GGUFSpec(a, kv, tensors)


def write_gguf(path, spec):
    """Writes spec with the gguf package's GGUFWriter. A tensor entry may be (name, array) or
    (name, array, raw_shape, raw_dtype) for a tensor info that disagrees with its data."""
    import gguf
    w = gguf.GGUFWriter(path, spec.arch)
    for key, vtype, value, sub in spec.kv:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for entry in spec.tensors:
        name, array = entry[0], entry[1]
        if len(entry) > 2:
            w.add_tensor(name, array, raw_shape=entry[2], raw_dtype=entry[3])
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class Corpus:
    """The originals, written under `root` on first use."""

    def __init__(self, root):
        self.root = root
        self.config = config()
        self.model = gyges.Model.random(self.config, MODEL_SEED)
        self.tensors = self.model.tensors  # the weights every file holds, float32, HF names
        self._spec = None

    def hf_dir(self):
        path = os.path.join(self.root, "hf")
        if not os.path.isdir(path):
            self._write_hf(path + ".tmp", shard_bytes=None)
            os.replace(path + ".tmp", path)
        return path

    def sharded_dir(self):
        path = os.path.join(self.root, "hf_sharded")
        if not os.path.isdir(path):
            self._write_hf(path + ".tmp", shard_bytes=40_000)
            os.replace(path + ".tmp", path)
        return path

    def _write_hf(self, path, shard_bytes):
        shutil.rmtree(path, ignore_errors=True)
        self.model.save(path, shard_bytes=shard_bytes)
        with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer_json())
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(tokenizer_config(), f, indent=2)

    def gguf_spec(self):
        if self._spec is None:
            self._spec = gguf_spec(self.model)
        return self._spec.copy()

    def gguf_file(self):
        path = os.path.join(self.root, "model.gguf")
        if not os.path.isfile(path):
            write_gguf(path + ".tmp", self.gguf_spec())
            os.replace(path + ".tmp", path)
        return path
