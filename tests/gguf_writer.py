"""A model's tensors as llama.cpp's converter writes them into a GGUF file, written here apart
from gyges' reader (gyges/models/gguf_file.py) so that the tests check one against the other:
GGUF names (blk.N.attn_q.weight, token_embd.weight, ...) and q/k rows in interleaved rotary
order."""
import numpy as np

from gyges.models import checkpoint, gguf_file


def permute(w, n_head):
    """llama.cpp's converter: each head's rows from halves to interleaved rotary pairs.
      w: (n_head * d, ...) -> same shape."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _sparse_layer_tensors(config, tensors, i):
    """{GGUF name: array} of sparse layer i's experts (stacked: (experts, rows, cols)), shared
    expert and routers, and the HF names they hold."""
    units = {unit: names for unit, names, _ in checkpoint.ffn_units(config, i)}
    out, used = {}, set()
    for gname, kind in gguf_file.EXPERT_NAMES.items():
        names = [units[f"e{j}"][kind] for j in range(config.num_experts)]
        out[f"blk.{i}.{gname}"] = np.stack([tensors[n] for n in names])
        used.update(names)
    for gname, kind in gguf_file.SHARED_NAMES.items():
        if "shared" in units:
            out[f"blk.{i}.{gname}"] = tensors[units["shared"][kind]]
            used.add(units["shared"][kind])
    extras = checkpoint.attention_extras(config, i)
    for gname, role in gguf_file.ROUTER_NAMES.items():
        if role in extras:
            t = tensors[extras[role][0]]
            out[f"blk.{i}.{gname}"] = t.reshape(-1) if role == "shared_gate" else t  # 1-D there
            used.add(extras[role][0])
    return out, used


def gguf_tensors(model):
    """{GGUF name: float32 array} of a gyges.Model's tensors, in the model's order (a sparse
    layer's experts stacked, as llama.cpp's converter writes them)."""
    c = model.config
    to_global = {v: k for k, v in gguf_file.GLOBAL_NAMES.items()}
    to_layer = {v: k for k, v in gguf_file.LAYER_NAMES.items()}
    out, done = {}, set()
    for name, t in model.tensors.items():
        if name in done:
            continue
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if c.is_sparse_layer(layer) and f"blk.{layer}.ffn_gate_inp.weight" not in out:
                sparse, used = _sparse_layer_tensors(c, model.tensors, layer)
                done |= used
                out.update((k, np.ascontiguousarray(v, dtype=np.float32)) for k, v in sparse.items())
                if name in used:
                    continue
            layer, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{layer}.{to_layer[rest]}"
        else:
            gname = to_global[name]
        permuted = c.model_type in ("llama", "mixtral")  # llama.cpp's converter's rows
        if permuted and name.endswith("q_proj.weight"):
            t = permute(t, c.num_attention_heads)
        elif permuted and name.endswith("k_proj.weight"):
            t = permute(t, c.num_key_value_heads)
        out[gname] = np.ascontiguousarray(t, dtype=np.float32)
    return out
