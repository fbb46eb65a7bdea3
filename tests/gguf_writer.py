"""A model's tensors as llama.cpp's converter writes them into a GGUF file, written here apart
from gyges' reader (gyges/models/gguf_file.py) so that the tests check one against the other:
GGUF names (blk.N.attn_q.weight, token_embd.weight, ...) and q/k rows in interleaved rotary
order."""
import numpy as np

from gyges.models import gguf_file


def permute(w, n_head):
    """llama.cpp's converter: each head's rows from halves to interleaved rotary pairs.
      w: (n_head * d, ...) -> same shape."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def gguf_tensors(model):
    """{GGUF name: float32 array} of a gyges.Model's tensors, in the model's order."""
    c = model.config
    to_global = {v: k for k, v in gguf_file.GLOBAL_NAMES.items()}
    to_layer = {v: k for k, v in gguf_file.LAYER_NAMES.items()}
    out = {}
    for name, t in model.tensors.items():
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{layer}.{to_layer[rest]}"
        else:
            gname = to_global[name]
        if name.endswith("q_proj.weight"):
            t = permute(t, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            t = permute(t, c.num_key_value_heads)
        out[gname] = np.ascontiguousarray(t, dtype=np.float32)
    return out
