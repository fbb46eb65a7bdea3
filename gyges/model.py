"""gyges.Model: a Llama-family decoder's configuration and weights, on the host.

    m = gyges.Model.tiny()                      # the embedded default, fixed seed, no download
    m = gyges.Model.random(config, seed=0)      # any shape
    m = gyges.Model.load("path/to/hf_checkpoint")
    m.save("out_dir", dtype="bf16")

A Model holds float32 arrays under Hugging Face names; an Engine or a Host places them in each
worker's arena (gyges/weights.py) in the storage dtype it is asked for.
"""
from . import checkpoint
from .config import ModelConfig
from .errors import ArgumentTypeError

TINY_SEED = 20251121


class Model:
    def __init__(self, config, tensors):
        if not isinstance(config, ModelConfig):
            raise ArgumentTypeError("config must be a gyges.config.ModelConfig")
        checkpoint.check_tensors(config, tensors)
        self.config = config
        self.tensors = dict(tensors)

    @classmethod
    def random(cls, config, seed=0):
        """A deterministic random model of any shape."""
        if isinstance(config, dict):
            config = ModelConfig.from_dict(config)
        return cls(config, checkpoint.random_weights(config, seed))

    @classmethod
    def tiny(cls):
        """The embedded default: 4 layers, hidden 256, 8 query heads, 4 KV heads, FFN 688,
        vocab 4096, built from a fixed seed."""
        return cls.random(ModelConfig.tiny(), TINY_SEED)

    @classmethod
    def load(cls, path):
        """A Hugging Face checkpoint directory: config.json plus *.safetensors."""
        config, tensors = checkpoint.load(path)
        return cls(config, tensors)

    def save(self, path, dtype="f32", shard_bytes=None):
        return checkpoint.save(path, self.config, self.tensors, dtype=dtype, shard_bytes=shard_bytes)

    def __repr__(self):
        c = self.config
        return (f"Model({c.model_type}, layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
                f"heads={c.num_attention_heads}/{c.num_key_value_heads}, "
                f"ffn={c.intermediate_size}, vocab={c.vocab_size}, "
                f"params={c.param_count():,})")
