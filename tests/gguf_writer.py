"""A model's tensors as llama.cpp's converter writes them into a GGUF file, written here apart
from gyges' reader (gyges/models/gguf_file.py) so that the tests check one against the other:
GGUF names (blk.N.attn_q.weight, token_embd.weight, ...) and q/k rows in interleaved rotary
order; write_gguf makes the file, its metadata under llama.cpp's architecture names."""
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


# gyges' model_type -> llama.cpp's architecture (Mixtral is a llama with experts)
ARCHITECTURES = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                 "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def write_gguf(path, model):
    """A GGUF file of `model` (the `gguf` package's writer): its architecture's metadata, the
    experts' included, and gguf_tensors. Returns path."""
    import gguf
    c = model.config
    arch = ARCHITECTURES[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    if c.is_moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if c.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if c.bos_token_id is not None:
        w.add_uint32("tokenizer.ggml.bos_token_id", c.bos_token_id)
    if c.eos_tokens():
        w.add_uint32("tokenizer.ggml.eos_token_id", c.eos_tokens()[0])
    for name, t in gguf_tensors(model).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
