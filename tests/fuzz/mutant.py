"""(seed, index) -> one mutant: the mutator is drawn by weight, then the mutator draws what it
changes, all from one rng seeded by the pair, so a finding is rebuilt exactly by its pair."""
import os
import random
from dataclasses import dataclass

from . import gguf_mutators, hf_mutators

# name -> (file kind, weight, mutator)
MUTATORS = {
    "config.field": ("hf", 14, hf_mutators.config_field),
    "config.rope_scaling": ("hf", 8, hf_mutators.config_rope_scaling),
    "config.document": ("hf", 4, hf_mutators.config_document),
    "safetensors.header": ("hf", 10, hf_mutators.safetensors_header),
    "safetensors.bytes": ("hf", 6, hf_mutators.safetensors_bytes),
    "safetensors.index": ("hf", 5, hf_mutators.safetensors_index),
    "tokenizer.json": ("hf", 6, hf_mutators.tokenizer_json),
    "tokenizer_config": ("hf", 8, hf_mutators.tokenizer_config),
    "gguf.metadata": ("gguf", 14, gguf_mutators.gguf_metadata),
    "gguf.tokenizer": ("gguf", 7, gguf_mutators.gguf_tokenizer),
    "gguf.tensors": ("gguf", 6, gguf_mutators.gguf_tensors),
    "gguf.bytes": ("gguf", 12, gguf_mutators.gguf_bytes),
}


@dataclass
class Mutant:
    seed: int
    index: int
    mutator: str
    kind: str             # "hf" (a directory) or "gguf" (a file)
    detail: str           # what was changed, in words
    path: str             # what gyges.Model.load is given
    tensors_intact: bool  # the file still holds the original weights (GGUF; HF is re-read)

    @property
    def replay(self):
        return f"python -m tests.fuzz replay --seed {self.seed} --index {self.index}"


def choose(seed, index):
    rng = random.Random(f"gyges-fuzz/{seed}/{index}")
    names = list(MUTATORS)
    name = rng.choices(names, weights=[MUTATORS[n][1] for n in names])[0]
    return name, rng


def build(corpus, seed, index, workdir, only=None):
    """Writes mutant (seed, index) under workdir. `only` forces a mutator (for tests)."""
    name, rng = choose(seed, index)
    if only is not None:
        name = only
    kind, _, mutate = MUTATORS[name]
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "model" if kind == "hf" else "model.gguf")
    result = mutate(rng, corpus, path)
    detail, intact = result if isinstance(result, tuple) else (result, False)
    return Mutant(seed, index, name, kind, detail, path, intact)
