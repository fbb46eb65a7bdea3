"""A worker: one arena (its "GPU"), the model weights placed in it, a paged KV cache for the KV
heads it holds, and the C model that runs forward passes on them.

An Engine has one worker; a Host has several, grouped into tensor-parallel instances.
"""
import numpy as np

from . import _C
from .arena import Arena
from .kv_cache import KVCache, layout_name
from .units import parse_size
from .weights import DTYPES, ModelWeights

WEIGHT_DTYPE_IDS = {"f32": 0, "f16": 1, "bf16": 2}


def default_max_tp(config, limit=4):
    """The largest TP degree up to `limit` that divides the heads, KV heads and FFN width: the
    FFN is cut into that many shards and o_proj's reduction into as many chunks."""
    tp = limit
    while tp > 1 and (config.num_attention_heads % tp or config.num_key_value_heads % tp
                      or config.intermediate_size % tp):
        tp //= 2
    return tp


class Worker:
    def __init__(self, model, memory="256MiB", page_size="64KiB", block_size=16,
                 kv_layout="header", weight_dtype="f32", max_tp=None, threads=2, max_pos=None,
                 backend="cpu", pad_ffn=True):
        config = model.config
        if weight_dtype not in DTYPES:
            raise ValueError(f"unknown weight dtype {weight_dtype!r}; expected one of "
                             f"{', '.join(DTYPES)}")
        self.config = config
        max_tp = default_max_tp(config) if max_tp is None else max_tp
        self.max_tp = max_tp
        self.page_size = parse_size(page_size, "page_size")
        budget = parse_size(memory, "memory")
        budget -= budget % self.page_size
        self.arena = Arena(budget=budget, page_size=self.page_size, backend=backend,
                           n_slots=8 * max(budget // self.page_size, 1))
        self.weights = ModelWeights(self.arena, config, model.tensors, dtype=weight_dtype,
                                    max_tp=max_tp, pad=pad_ffn)
        self.weights_bytes = self.arena.stats()["bytes_in_use"]
        first = self.weights.end_slot
        self.kv = KVCache(self.arena, n_layers=config.num_hidden_layers,
                          n_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                          block_size=block_size, layout=layout_name(kv_layout), first_slot=first,
                          slots_per_layer=(self.arena.n_slots - first) // config.num_hidden_layers)
        self.max_pos = max_pos or config.max_position_embeddings
        spec = (config.vocab_size, config.hidden_size, config.intermediate_size,
                config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                config.head_dim, max_tp, self.max_pos, WEIGHT_DTYPE_IDS[weight_dtype],
                float(config.rms_norm_eps), float(config.rope_theta))
        self.c_model = _C.Model(self.arena._c, spec, self.weights.c_offsets(),
                                (1 << max_tp) - 1, threads)

    def kv_pages_free(self):
        """Pages of the budget not in use, as whole KV pages across all layers."""
        s = self.arena.stats()
        return (s["budget_bytes"] - s["bytes_in_use"]) // self.page_size // self.config.num_hidden_layers

    def forward(self, tokens, token_seq, token_pos, block_tables, logit_rows):
        """One forward pass (TP1) over tokens of several sequences; returns the logits of
        logit_rows. block_tables: list of int32 arrays, indexed by token_seq."""
        i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)
        indptr = np.zeros(len(block_tables) + 1, dtype=np.int32)
        indptr[1:] = np.cumsum([len(t) for t in block_tables])
        indices = i32(np.concatenate(block_tables)) if block_tables else np.zeros(0, np.int32)
        rows = i32(logit_rows)
        logits = np.empty((len(rows), self.config.vocab_size), dtype=np.float32)
        self.c_model.forward(self.kv._c, i32(tokens), i32(token_seq), i32(token_pos), indptr,
                             indices, rows, logits)
        return logits
