"""A worker's model weights placed in its arena, with the FFN padded as in Gyges section 4.2.

Replicated tensors (embedding, norms, attention projections, LM head) are packed into runs of
pages, one run each for the embedding, every layer's attention (its norms, q/k/v/o and biases)
and the head (final norm, LM head), so that a worker can drop and restore whole layers (a
pipeline stage keeps its own; KunServe drops replicated ones under memory pressure) and the
embedding or head; o_proj is stored transposed, (heads * head_dim, hidden), so that the heads of a TP rank
are a run of rows. The FFN of every layer is cut along the intermediate dimension into `max_tp` shards, and
each shard of gate, up and down starts on a page boundary with zero padding after it (Gyges
eq. 2: U' = [U1, 0, U2, 0, ...], D' = [D1; 0; D2; 0; ...]). A worker that joins a TPk group keeps
the shards it owns and unmaps the others: no byte is copied and the pages go back to the budget
at once. Down is stored transposed, (intermediate, hidden), so that a shard is a run of rows.

    gate, up: shard s = rows [s*I/max_tp, (s+1)*I/max_tp) of the HF (I, hidden) matrix
    down:     shard s = the same rows of down.T, i.e. (I/max_tp, hidden)

The padding is never computed on: kernels take each shard's pointer and its true row count, so
the padded FFN gives exactly the unpadded result. `padding_bytes` reports what it costs.

A mixture-of-experts layer has several FFNs (checkpoint.ffn_units: its experts, then Qwen2-MoE's
shared expert), each cut into max_tp shards exactly like the dense one and placed one after the
other: expert e's gate, up and down are a run of pages of their own (keys "e<e>.gate", ...), so
an expert can be dropped and restored whole; its router (and the shared expert's gate, Qwen3's
q/k norms) are small replicated tensors in the layer's attention run.
"""
import numpy as np

from .arena import Arena
from ..models.checkpoint import attention_extras, ffn_units
from ..models.config import ModelConfig
from ..core.errors import ArgumentTypeError, InvalidArgumentError, OutOfMemoryError
from ..models.safetensors import f32_to_bf16

MAX_TP = 8  # GY_MODEL_MAX_TP (csrc/engine/model.h)
DTYPES = {"f32": (np.float32, 4, 0), "bf16": (np.uint16, 2, 2), "f16": (np.float16, 2, 1)}
ALIGN = 64  # bytes: one cache line, and the widest vector load
FFN_KINDS = ("gate", "up", "down")


def _round_up(x, to):
    return -(-x // to) * to


def _runs(slots):
    """(start, length) of each run of consecutive numbers in sorted `slots`."""
    runs = []
    for s in slots:
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return [tuple(r) for r in runs]


def _encode(array, dtype):
    array = np.asarray(array, dtype=np.float32)
    if dtype == "bf16":
        return f32_to_bf16(array)
    return array.astype(DTYPES[dtype][0])


def layer_names(config, i):
    """HF names of layer i's attention tensors (its run), in storage order."""
    p = f"model.layers.{i}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
    if config.attention_bias:
        names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    return names + [name for name, _ in attention_extras(config, i).values()]


def ffn_matrices(config, i):
    """Layer i's FFN matrices in storage order, each (key, HF name, width): keys "gate", "up",
    "down" of a dense layer; "e<j>.gate", "e<j>.up", "e<j>.down" of expert j and "shared.gate",
    ... of the shared expert in an MoE layer. Down is stored transposed, (width, hidden)."""
    return [(kind if unit is None else f"{unit}.{kind}", names[kind], width)
            for unit, names, width in ffn_units(config, i) for kind in FFN_KINDS]


class MatrixPages:
    """The pages of one FFN matrix of `width` rows cut into max_tp shards (Gyges eq. 2):
    shard_rows, shard_bytes, tensor_slots (all its shards), shard_slots (one padded shard's;
    None unpadded)."""

    def __init__(self, width, hidden, dtype, max_tp, page_size, pad):
        self.shard_rows = width // max_tp
        self.shard_bytes = self.shard_rows * hidden * DTYPES[dtype][1]
        tensor_bytes = (_round_up(self.shard_bytes, page_size) * max_tp if pad
                        else self.shard_bytes * max_tp)
        self.tensor_slots = _round_up(tensor_bytes, page_size) // page_size
        self.shard_slots = self.tensor_slots // max_tp if pad else None

    def slots_holding(self, shards, page_size):
        """Slots the matrix maps holding `shards` of its shards (unpadded: packed together)."""
        if self.shard_slots is not None:
            return self.shard_slots * shards
        return -(-(shards * self.shard_bytes) // page_size)


def replicated_runs(config):
    """The runs of replicated tensors, in storage order: ("embed", names), (layer, names) for
    each layer, ("head", names). A tied LM head is the embedding: the head run has the final
    norm only."""
    runs = [("embed", ["model.embed_tokens.weight"])]
    runs += [(i, layer_names(config, i)) for i in range(config.num_hidden_layers)]
    runs.append(("head", ["model.norm.weight"] +
                 ([] if config.tie_word_embeddings else ["lm_head.weight"])))
    return runs


def replicated_names(config):
    """HF names of the tensors every worker holds whole, in storage order."""
    return [name for _, names in replicated_runs(config) for name in names]


def _oriented(name, array):
    """Tensors as stored: o_proj transposed, the rest as given."""
    array = np.asarray(array)
    return array.T if name.endswith("o_proj.weight") else array


def _is_matrix(name):
    # Norms, biases and routers stay fp32 whatever the storage dtype: they are tiny and
    # precision-critical (a router's rounding could change which experts a token goes to).
    return name.endswith("proj.weight") or name.endswith("embed_tokens.weight") or name == "lm_head.weight"


class WeightPages:
    """Where a model's weights go in an arena of `page_size` pages, before anything is placed:
    what ModelWeights lays out and what a default memory budget is sized from (worker.py).

    runs: {run key: (first slot, slots)} relative to the first slot; plan: (name, byte offset
    relative to the first slot, stored dtype) of each replicated tensor; matrices[layer]: (key, HF
    name, MatrixPages) of each FFN matrix in storage order; tensor_slots, shard_bytes: a dense
    layer's FFN matrix's; slots: everything (replicated runs, then each layer's FFN matrices)."""

    def __init__(self, config, tensors, dtype, max_tp, page_size, pad):
        self.runs, self.plan = {}, []
        run_slot = packed = 0
        for key, names in replicated_runs(config):
            cursor = 0  # bytes into the run
            for name in names:
                if name not in tensors:
                    raise InvalidArgumentError(f"tensor {name!r} is missing")
                stored = dtype if _is_matrix(name) else "f32"
                nbytes = int(np.prod(tensors[name].shape)) * DTYPES[stored][1]
                self.plan.append((name, run_slot * page_size + cursor, stored))
                cursor = _round_up(cursor + nbytes, ALIGN)
            slots = max(_round_up(cursor, page_size) // page_size, 1)
            self.runs[key] = (run_slot, slots)
            run_slot += slots
            packed += cursor
        self.replicated_slots, self.packed = run_slot, packed
        dense = MatrixPages(config.intermediate_size, config.hidden_size, dtype, max_tp,
                            page_size, pad)
        self.shard_bytes, self.tensor_slots = dense.shard_bytes, dense.tensor_slots
        self.shard_slots = dense.shard_slots
        # Padded: each shard gets whole pages. Unpadded: a tensor's shards are packed together.
        self.matrices = [[(key, name, MatrixPages(width, config.hidden_size, dtype, max_tp,
                                                  page_size, pad))
                          for key, name, width in ffn_matrices(config, i)]
                         for i in range(config.num_hidden_layers)]
        self.slots = self.replicated_slots + sum(m.tensor_slots for layer in self.matrices
                                                 for _, _, m in layer)
        self.bytes = self.slots * page_size


class ModelWeights:
    """ModelWeights(arena, config, tensors, dtype="f32", max_tp=4, first_slot=0, pad=True)

    Places the tensors (HF names, float arrays) in `arena` from `first_slot` on. Attributes:
    offsets[name] = (byte offset in the arena, shape, dtype name); ffn[layer][kind][shard] =
    (byte offset, rows); runs[key] = (first slot, slots) of each replicated run ("embed", a layer
    index, "head"); padding_bytes; bytes_total. What the worker holds: `held` (FFN shards),
    `held_layers`, `has_embed`, `has_head`. pad=False packs each tensor's shards
    back to back instead (the unpadded reference layout; shards then share pages and cannot be
    released one by one).
    """

    def __init__(self, arena, config, tensors, dtype="f32", max_tp=4, first_slot=0, pad=True):
        if not isinstance(arena, Arena):
            raise ArgumentTypeError("arena must be a gyges.Arena")
        if not isinstance(config, ModelConfig):
            raise ArgumentTypeError("config must be a gyges.config.ModelConfig")
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"unknown weight dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
        if not 1 <= max_tp <= MAX_TP:
            raise InvalidArgumentError(f"max_tp must be in [1, {MAX_TP}], got {max_tp}")
        for field in ("intermediate_size", "moe_intermediate_size",
                      "shared_expert_intermediate_size"):
            if getattr(config, field) % max_tp:
                raise InvalidArgumentError(f"{field} {getattr(config, field)} is not divisible by "
                                           f"max_tp={max_tp}")
        self.arena, self.config, self.dtype, self.max_tp = arena, config, dtype, max_tp
        self._host = tensors  # the host copy, for restoring dropped shards
        self.page_size = arena.page_size
        hidden, inter = config.hidden_size, config.intermediate_size
        self.shard_rows = inter // max_tp

        # Replicated tensors: one packed run of pages per run key, each on its own pages.
        layout = WeightPages(config, tensors, dtype, max_tp, self.page_size, pad)
        self.offsets = {}
        self.runs = {key: (first_slot + slot, n) for key, (slot, n) in layout.runs.items()}
        self.replicated_slots = layout.replicated_slots
        self.run_names = dict(replicated_runs(config))
        self.pad = pad
        self.tensor_slots, self.shard_slots = layout.tensor_slots, layout.shard_slots
        self.shard_bytes = layout.shard_bytes
        self._check_room(first_slot, layout.slots)
        self.first_slot = first_slot
        base = first_slot * self.page_size
        arena.grow(first_slot, self.replicated_slots, "weights")
        for name, offset, stored in layout.plan:
            array = _oriented(name, tensors[name])
            self._store(base + offset, array, stored)
            self.offsets[name] = (base + offset, array.shape, stored)
        self.replicated_bytes = layout.packed

        # FFN shards: each on its own page-aligned run of slots.
        self._matrix = {}   # (layer, key) -> (HF name, MatrixPages)
        self.ffn = []       # [layer][key] -> [(byte offset, rows) of each shard]
        self.ffn_pages = {}  # (layer, key) -> (first slot, mapped slots) of the tensor
        slot = first_slot + self.replicated_slots
        for i, matrices in enumerate(layout.matrices):
            layer = {}
            for key, name, m in matrices:
                mat = np.asarray(tensors[name])
                mat = mat.T if key.endswith("down") else mat
                if mat.shape != (m.shard_rows * max_tp, hidden):
                    raise InvalidArgumentError(f"{name} has shape {tensors[name].shape}, which does "
                                               f"not fit a width of {m.shard_rows * max_tp}")
                self._matrix[(i, key)] = (name, m)
                shards = []
                arena.grow(slot, m.tensor_slots, "weights")
                self.ffn_pages[(i, key)] = (slot, m.tensor_slots)
                for s in range(max_tp):
                    offset = slot * self.page_size + (s * m.shard_slots * self.page_size
                                                      if pad else s * m.shard_bytes)
                    self._store(offset, mat[s * m.shard_rows:(s + 1) * m.shard_rows], dtype)
                    shards.append((offset, m.shard_rows))
                slot += m.tensor_slots
                layer[key] = shards
            self.ffn.append(layer)
        self.end_slot = slot
        self.held = set(range(max_tp))  # FFN shards whose pages this worker still has
        # Expert parallelism (hold_experts_whole): the experts held whole, every shard of each;
        # None while experts are TP-sharded like the dense FFN (each held expert's `held` shards).
        self.held_experts = None
        self._expert_layers = {}        # layer -> experts it holds, where a staggered change
                                        # has made that differ from held_experts
        self.held_layers = set(range(config.num_hidden_layers))
        self.has_embed = self.has_head = True
        self._dropped = set()           # (layer, shard) released by a staggered transformation
        self._restored = set()          # (layer, shard) mapped again by a staggered scale-down
        matrices = [m for _, m in self._matrix.values()]
        self.padding_bytes = sum(m.tensor_slots * self.page_size - m.shard_bytes * max_tp
                                 for m in matrices)
        self.unpadded_bytes = self.replicated_bytes + sum(m.shard_bytes * max_tp for m in matrices)
        self.bytes_total = (self.end_slot - first_slot) * self.page_size

    def _check_room(self, first_slot, n_slots, in_place=False):
        # Checked before anything is placed, so a model that does not fit leaves no pages behind.
        stats = self.arena.stats()
        free = stats["budget_bytes"] - stats["bytes_in_use"]
        if n_slots * self.page_size > free:
            raise OutOfMemoryError(
                f"the weights need {n_slots * self.page_size:,} bytes ({n_slots} pages of "
                f"{self.page_size:,}) but only {free:,} of the arena's {stats['budget_bytes']:,} "
                f"are free")
        if not in_place and (first_slot < 0 or first_slot + n_slots > self.arena.n_slots):
            raise InvalidArgumentError(f"the weights need slots [{first_slot}, {first_slot + n_slots}) but "
                             f"the arena has {self.arena.n_slots}")

    def _store(self, offset, array, stored):
        # Through the arena's copy-in path: host memory or device memory alike.
        self.arena.write(offset, _encode(array, stored))

    def kinds(self, layer):
        """Layer `layer`'s FFN matrix keys in storage order ("gate", "up", "down"; in an MoE
        layer "e0.gate", ..., "shared.down")."""
        return list(self.ffn[layer])

    def shard_offset(self, layer, kind, shard):
        """Byte offset of one FFN shard in the arena."""
        return self.ffn[layer][kind][shard][0]

    def shard_slots_of(self, layer, kind, shard):
        """The slots a padded shard owns alone (what a TP worker unmaps when it drops it)."""
        if not self.pad:
            raise InvalidArgumentError("unpadded shards share pages; they cannot be released one by one")
        first = self.ffn[layer][kind][shard][0] // self.page_size
        return range(first, first + self._matrix[(layer, kind)][1].shard_slots)

    def _sharded_kinds(self, layer):
        """The matrices whose shards `held` says: all, but the experts' when they are held whole
        (expert parallelism)."""
        if self.held_experts is None:
            return self.kinds(layer)
        return [k for k in self.kinds(layer) if not (k[0] == "e" and k[1].isdigit())]

    def hold_experts_whole(self):
        """Expert parallelism from here on: each expert is held whole (every shard, one run of
        pages: expert_slots) or not at all, by drop_experts / restore_layer_experts, while the
        dense FFN and the shared expert stay sharded by `held`. On padded weights that hold
        every shard."""
        if not self.pad or self.held != set(range(self.max_tp)):
            raise InvalidArgumentError("experts are held whole by padded weights that hold every "
                                       "shard")
        self.held_experts = set(range(self.config.num_experts))

    def experts_present(self, layer):
        """The experts layer `layer` holds whole now (a staggered change drops and restores them
        a layer at a time before held_experts says so)."""
        return set(self._expert_layers.get(layer, self.held_experts))

    def drop_layer_experts(self, layer, keep):
        """Unmaps the experts of MoE layer `layer` not in `keep`, each whole; held_experts
        changes once every layer is done (finish_layer_experts). Returns the bytes given back."""
        if self.held_experts is None or not self.config.is_sparse_layer(layer):
            return 0
        freed = 0
        for e in sorted(self.experts_present(layer) - set(keep)):
            slots = self.expert_slots(layer, e)
            self.arena.shrink(slots.start, len(slots))
            self._expert_layers[layer] = self.experts_present(layer) - {e}
            freed += len(slots) * self.page_size
        return freed

    def restore_layer_experts(self, layer, experts, source=None):
        """Maps and fills the experts of MoE layer `layer` in `experts` it lacks, each whole or
        not at all: copied from source(expert), the ModelWeights of a peer holding it there
        (same placement, same offsets), or from the host copy. Returns the bytes copied."""
        if self.held_experts is None or not self.config.is_sparse_layer(layer):
            return 0
        copied = 0
        for e in sorted(set(experts) - self.experts_present(layer)):
            peer = source(e) if source is not None else None
            if peer is not None and e not in peer.experts_present(layer):
                raise InvalidArgumentError(f"the peer does not hold expert {e} of layer {layer}")
            slots = self.expert_slots(layer, e)
            copied += self._map_and_fill([(slots.start, len(slots))], lambda: sum(
                self._fill_shard(layer, f"e{e}.{kind}", s, peer)
                for kind in FFN_KINDS for s in range(self.max_tp)))
            self._expert_layers[layer] = self.experts_present(layer) | {e}
        return copied

    def finish_layer_experts(self, experts):
        """Every layer holds `experts` now (a staggered drop is done): held_experts says so."""
        if self.held_experts is not None:
            self.held_experts = set(experts)
            self._expert_layers.clear()

    def finish_layer_expert_restores(self, experts):
        """Every layer holds `experts` beside those it held (a staggered restore is done)."""
        if self.held_experts is not None:
            self.finish_layer_experts(self.held_experts | set(experts))

    def drop_experts(self, keep):
        """Unmaps every MoE layer's experts not in `keep`, whole (a worker joining an expert-
        parallel TP group keeps its own). Returns the bytes given back."""
        if self.held_experts is None:
            raise InvalidArgumentError("experts are dropped whole only by weights that hold them "
                                       "whole (hold_experts_whole)")
        freed = sum(self.drop_layer_experts(layer, keep) for layer in sorted(self.held_layers))
        self.finish_layer_experts(set(keep) & self.held_experts)
        return freed

    def restore_experts(self, experts, source=None):
        """restore_layer_experts for every held layer, then held_experts says so. Returns the
        bytes copied."""
        copied = sum(self.restore_layer_experts(layer, experts, source)
                     for layer in sorted(self.held_layers))
        self.finish_layer_expert_restores(experts)
        return copied

    def expert_slots_to_restore(self, experts):
        """Slots every held MoE layer must map to hold `experts` whole."""
        if self.held_experts is None:
            return 0
        return sum(len(self.expert_slots(layer, e)) for layer in sorted(self.held_layers)
                   if self.config.is_sparse_layer(layer)
                   for e in set(experts) - self.experts_present(layer))

    def ffn_slots(self, shards):
        """The slots every layer's FFN matrices map holding `shards` of their shards (the
        experts' not counted where they are held whole)."""
        return sum(self._matrix[(layer, kind)][1].slots_holding(shards, self.page_size)
                   for layer in range(len(self.ffn)) for kind in self._sharded_kinds(layer))

    def expert_slots(self, layer, expert):
        """The slots of expert `expert` of an MoE layer: its gate, up and down, one run of pages
        of their own (what dropping the expert whole would give back)."""
        runs = [self.ffn_pages[(layer, f"e{expert}.{kind}")] for kind in FFN_KINDS]
        return range(runs[0][0], runs[-1][0] + runs[-1][1])

    def padding_overhead(self):
        """Padding bytes as a fraction of the unpadded weights (Gyges Figure 10b: 0 to 14%)."""
        return self.padding_bytes / self.unpadded_bytes

    def drop_shards(self, keep):
        """Unmaps and releases the pages of every FFN shard not in `keep` (Gyges scale-up: each
        worker keeps its own shards; no byte is copied). Returns the bytes given back."""
        keep = set(keep)
        if not keep <= self.held:
            raise InvalidArgumentError(f"cannot keep FFN shards {sorted(keep - self.held)}: not held")
        before = self.arena.stats()["bytes_in_use"]
        for layer in sorted(self.held_layers):
            self.drop_layer_shards(layer, keep)
        self.finish_layer_drops(keep)
        return before - self.arena.stats()["bytes_in_use"]

    def bytes_freed_keeping(self, keep):
        """The bytes drop_shards (padded) or partial_swap (unpadded) would give back."""
        keep = set(keep) & self.held
        if self.pad:
            return sum(len(self.held - keep) * self._matrix[(layer, kind)][1].shard_slots
                       for layer in sorted(self.held_layers)
                       for kind in self._sharded_kinds(layer)) * self.page_size
        return sum(max(mapped - self._matrix[key][1].slots_holding(len(keep), self.page_size), 0)
                   for key, (_, mapped) in self.ffn_pages.items()) * self.page_size

    def partial_swap(self, keep):
        """The baseline of Gyges section 4.2 for unpadded weights: the shards a worker keeps share
        pages with the others, so each tensor's kept shards are copied to the front of its pages
        and the pages past them are released. Returns (bytes copied, bytes released)."""
        if self.pad:
            raise InvalidArgumentError("partial_swap is for unpadded weights; padded shards are released "
                             "page by page (drop_shards)")
        keep = sorted(set(keep))
        if not set(keep) <= self.held:
            raise InvalidArgumentError(f"cannot keep FFN shards {sorted(set(keep) - self.held)}: not held")
        copied = released = 0
        for layer in sorted(self.held_layers):
            for kind in self.kinds(layer):
                shard_bytes = self._matrix[(layer, kind)][1].shard_bytes
                shards = self.ffn[layer][kind]
                base, mapped = self.ffn_pages[(layer, kind)]
                start = base * self.page_size
                for i, s in enumerate(keep):  # kept shards to the front, in order
                    src, rows = shards[s]
                    dst = start + i * shard_bytes
                    if src != dst:
                        self.arena.copy(dst, src, shard_bytes)
                        copied += shard_bytes
                    shards[s] = (dst, rows)
                used = -(-(len(keep) * shard_bytes) // self.page_size)
                if mapped > used:
                    self.arena.shrink(base + used, mapped - used)
                    released += (mapped - used) * self.page_size
                    self.ffn_pages[(layer, kind)] = (base, used)
        self.held = set(keep)
        return copied, released

    def drop_layer_shards(self, layer, keep):
        """drop_shards for one layer (a layer-staggered transformation moves a layer at a time);
        `held` changes once every layer has been done (finish_layer_drops). Returns the bytes
        given back."""
        drop = [shard for shard in sorted(self.held - set(keep)) if (layer, shard) not in self._dropped]
        slots = sorted(s for shard in drop for kind in self._sharded_kinds(layer)
                       for s in self.shard_slots_of(layer, kind, shard))
        # One call per run of neighbouring slots: each call is one TLB flush of every core
        # running the serving threads (a layer's gate, up and down shards are neighbours).
        for start, n in _runs(slots):
            self.arena.shrink(start, n)
        self._dropped.update((layer, shard) for shard in drop)
        return len(slots) * self.page_size

    def finish_layer_drops(self, keep):
        self.held = set(keep)
        self._dropped.clear()

    def restore_layer_shards(self, layer, shards, source=None):
        """restore_shards for one layer (a layer-staggered scale-down); `held` changes once
        every layer is done (finish_layer_restores). Returns the bytes copied."""
        copied = 0
        for shard in sorted(set(shards) - self.held):
            if (layer, shard) in self._restored:
                continue
            peer = source(shard) if source is not None else None
            kinds = self._sharded_kinds(layer)
            runs = [(slots.start, len(slots)) for slots in
                    (self.shard_slots_of(layer, kind, shard) for kind in kinds)]
            # a shard comes back whole or not at all, so a failed step can be retried
            copied += self._map_and_fill(runs, lambda: sum(
                self._fill_shard(layer, kind, shard, peer) for kind in kinds))
            self._restored.add((layer, shard))
        return copied

    def _fill_shard(self, layer, kind, shard, peer):
        """Writes one FFN shard (its pages mapped) from the peer ModelWeights or the host copy;
        returns the bytes written."""
        offset = self.shard_offset(layer, kind, shard)
        name, m = self._matrix[(layer, kind)]
        if peer is not None:
            one = np.array([offset], dtype=np.uint64)
            self.arena.copy_runs(peer.arena, one, one, np.array([m.shard_bytes], np.uint64))
        else:
            mat = np.asarray(self._host[name])
            mat = mat.T if kind.endswith("down") else mat
            self._store(offset, mat[shard * m.shard_rows:(shard + 1) * m.shard_rows], self.dtype)
        return m.shard_bytes

    def finish_layer_restores(self, shards):
        self.held |= set(shards)
        self._restored.clear()

    def restore_shards(self, shards, source=None):
        """Maps and fills FFN shards again (Gyges scale-down): copied from `source(shard)`, the
        ModelWeights of a peer worker that holds it (same placement, so same offsets), or from the
        host copy of the weights when source is None. Returns the bytes copied."""
        for shard in sorted(set(shards) - self.held):
            peer = source(shard) if source is not None else None
            if peer is not None and shard not in peer.held:
                raise InvalidArgumentError(f"the peer does not hold FFN shard {shard}")
        copied = sum(self.restore_layer_shards(layer, shards, source)
                     for layer in sorted(self.held_layers))
        self.finish_layer_restores(shards)
        return copied

    # ---- whole layers, the embedding and the head ----

    def _layer_slots(self, layer):
        """The slots of a layer's attention run and of its held FFN shards (whole tensors when
        unpadded), as runs of neighbouring slots."""
        first, n = self.runs[layer]
        slots = list(range(first, first + n))
        for kind in self.kinds(layer):
            if self.pad:
                slots += [x for shard in sorted(self.held) for x in self.shard_slots_of(layer, kind, shard)]
            else:
                base, mapped = self.ffn_pages[(layer, kind)]
                slots += list(range(base, base + mapped))
        return _runs(sorted(slots))

    def layer_bytes(self, layer):
        """What holding one layer costs: its attention run and its held FFN shards."""
        return sum(n for _, n in self._layer_slots(layer)) * self.page_size

    def drop_layers(self, layers):
        """Unmaps whole layers (attention run and held FFN shards); returns the bytes freed."""
        layers = set(layers)
        if not layers <= self.held_layers:
            raise InvalidArgumentError(f"cannot drop layers {sorted(layers - self.held_layers)}: "
                                       f"not held")
        before = self.arena.stats()["bytes_in_use"]
        for layer in sorted(layers):
            for start, n in self._layer_slots(layer):
                self.arena.shrink(start, n)
            self.held_layers.discard(layer)
        return before - self.arena.stats()["bytes_in_use"]

    def _fill(self, names, source):
        """Writes tensors again: copied from the peer ModelWeights `source` (same placement, same
        offsets) or from the host copy. Returns the bytes written."""
        written = 0
        for name in names:
            offset, shape, stored = self.offsets[name]
            nbytes = int(np.prod(shape)) * DTYPES[stored][1]
            if source is not None:
                one = np.array([offset], dtype=np.uint64)
                self.arena.copy_runs(source.arena, one, one, np.array([nbytes], np.uint64))
            else:
                self._store(offset, _oriented(name, self._host[name]), stored)
            written += nbytes
        return written

    def restore_layers(self, layers, source=None):
        """Maps and fills whole layers again, from a peer holding them (`source`, its
        ModelWeights) or from the host copy; the FFN shards restored are the ones held.
        Returns the bytes copied."""
        if not self.pad:
            raise InvalidArgumentError("unpadded weights cannot restore layers (their shards "
                                       "share pages); place them with pad=True")
        layers = set(layers) - self.held_layers
        if source is not None and (not layers <= source.held_layers or not self.held <= source.held):
            raise InvalidArgumentError(f"the peer does not hold layers {sorted(layers)} with FFN "
                                       f"shards {sorted(self.held)}")
        runs = [run for layer in sorted(layers) for run in self._layer_slots(layer)]
        if runs:
            self._check_room(self.first_slot, sum(n for _, n in runs), in_place=True)

        def fill():
            return sum(self._fill(self.run_names[layer], source)
                       + sum(self._fill_shard(layer, kind, shard, source)
                             for shard in sorted(self.held) for kind in self.kinds(layer))
                       for layer in sorted(layers))
        copied = self._map_and_fill(runs, fill)
        self.held_layers |= layers
        return copied

    def _map_and_fill(self, runs, fill):
        """Maps the slot runs [(start, n), ...], then fill() writes them; all or nothing: when a
        page or a copy fails, the runs mapped here are released again and the error raised, so a
        restore that fails leaves the weights as they were. Returns fill()'s result."""
        mapped = []
        try:
            for start, n in runs:
                self.arena.grow(start, n, "weights")
                mapped.append((start, n))
            return fill()
        except BaseException:
            for start, n in reversed(mapped):
                self.arena.shrink(start, n)
            raise

    def set_ends(self, embed, head, source=None):
        """Holds the embedding and the head (final norm, LM head) or not: a pipeline's first
        stage needs the embedding, its last the head (and the embedding, when the LM head is
        tied to it). Returns the bytes copied to restore what comes back."""
        changes = [key for key, want, have in (("embed", embed, self.has_embed),
                                               ("head", head, self.has_head)) if want != have]
        back = [key for key in changes if (embed if key == "embed" else head)]
        runs = [self.runs[key] for key in back]
        if runs:
            self._check_room(self.first_slot, sum(n for _, n in runs), in_place=True)
        # What comes back first (all or nothing), then what goes, which cannot fail.
        copied = self._map_and_fill(runs, lambda: sum(self._fill(self.run_names[key], source)
                                                      for key in back))
        for key in changes:
            if key not in back:
                self.arena.shrink(*self.runs[key])
        self.has_embed, self.has_head = bool(embed), bool(head)
        return copied

    # ---- coming back to an earlier state (a reconfiguration's rollback) ----
    def _present(self, layer):
        """The FFN shards layer `layer` has mapped now (a staggered change drops and restores
        them a layer at a time before `held` says so)."""
        if layer not in self.held_layers:
            return set()
        return ({s for s in self.held if (layer, s) not in self._dropped}
                | {s for s in range(self.max_tp) if (layer, s) in self._restored})

    def checkpoint(self):
        """What the weights hold now, for rollback(): the layers, shards and ends (and, unpadded,
        where each shard sits)."""
        return {"layers": {layer: self._present(layer) for layer in self.held_layers},
                "held": set(self.held), "embed": self.has_embed, "head": self.has_head,
                "experts": None if self.held_experts is None else {
                    layer: self.experts_present(layer) for layer in self.held_layers},
                "held_experts": None if self.held_experts is None else set(self.held_experts),
                "packed": None if self.pad else ([{k: list(v) for k, v in layer.items()}
                                                  for layer in self.ffn], dict(self.ffn_pages))}

    def rollback(self, cp):
        """Holds exactly what checkpoint() saw again: what was dropped since is mapped and filled
        from the host copy (the same bytes it had), what was added is unmapped, and unpadded
        tensors a partial swap packed go back to their places. Raises when a page cannot be
        had (the caller's rollback then failed)."""
        if cp["packed"] is not None:
            return self._unpack(cp)
        want = cp["layers"]
        for layer in sorted(set(self.held_layers) - set(want)):  # layers added since
            self._drop_present(layer)
        for layer in sorted(want):
            have = self._present(layer)
            if layer not in self.held_layers:  # the attention run comes back first
                first, n = self.runs[layer]
                self._map_and_fill([(first, n)], lambda: self._fill(self.run_names[layer], None))
                self.held_layers.add(layer)
                self._dropped.update((layer, s) for s in self.held)  # none of its shards yet
                self._restored.difference_update((layer, s) for s in range(self.max_tp))
                have = set()
            kinds = self._sharded_kinds(layer)
            for shard in sorted(have - want[layer]):
                for kind in kinds:
                    r = self.shard_slots_of(layer, kind, shard)
                    self.arena.shrink(r.start, len(r))
            for shard in sorted(want[layer] - have):
                runs = [(r.start, len(r)) for r in
                        (self.shard_slots_of(layer, kind, shard) for kind in kinds)]
                self._map_and_fill(runs, lambda: sum(self._fill_shard(layer, kind, shard, None)
                                                     for kind in kinds))
            if cp["experts"] is not None:   # experts held whole: each layer's as they were
                self.drop_layer_experts(layer, cp["experts"][layer])
                self.restore_layer_experts(layer, cp["experts"][layer])
            # the layer holds want[layer] now; record it against `held` once every layer is done
            for shard in range(self.max_tp):
                self._dropped.discard((layer, shard))
                self._restored.discard((layer, shard))
        self.held = set(cp["held"])
        if cp["experts"] is not None:
            self.held_experts = set(cp["held_experts"])
            self._expert_layers = {layer: e for layer, e in cp["experts"].items()
                                   if e != self.held_experts}
        self._dropped = {(layer, s) for layer, shards in want.items()
                         for s in self.held - shards}
        self._restored = {(layer, s) for layer, shards in want.items()
                          for s in shards - self.held}
        self.set_ends(cp["embed"], cp["head"])

    def _drop_present(self, layer):
        first, n = self.runs[layer]
        self.arena.shrink(first, n)
        for shard in sorted(self._present(layer)):
            for kind in self._sharded_kinds(layer):
                r = self.shard_slots_of(layer, kind, shard)
                self.arena.shrink(r.start, len(r))
        self.drop_layer_experts(layer, ())
        self.held_layers.discard(layer)

    def _unpack(self, cp):
        """Undoes partial_swap: each tensor's pages mapped again and every shard written back
        at its place from the host copy."""
        shards_at, pages = cp["packed"]
        for (layer, kind), (base, mapped) in sorted(pages.items()):
            _, now = self.ffn_pages[(layer, kind)]
            if now < mapped:
                self._map_and_fill([(base + now, mapped - now)], lambda: 0)
            self.ffn_pages[(layer, kind)] = (base, mapped)
            self.ffn[layer][kind] = list(shards_at[layer][kind])
            for shard in range(self.max_tp):
                self._fill_shard(layer, kind, shard, None)
        self.held = set(cp["held"])

    def c_offsets(self, shards=None, pending=False, layers=None, experts=None):
        """The int64 offsets array gyges._C.Model takes (-1 for absent tensors); `shards` limits
        the FFN shards given to a subset of those held (default: all held). pending=True gives
        the offsets of shards not held yet too (a staggered scale-down maps them layer by layer,
        before the model uses them), and of `experts` (those held whole by the model, default
        held_experts) not held yet. `layers` (a set) limits the layers given to those of the
        ones held (a model of part of what a worker holds)."""
        experts = self.held_experts if experts is None else set(experts)
        shards = self.held if shards is None else (set(shards) if pending else set(shards) & self.held)
        cfg = self.config
        per_ffn = 3 * self.max_tp
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        out = [self._offset("model.embed_tokens.weight") if self.has_embed else -1,
               self._offset("model.norm.weight") if self.has_head else -1,
               self._offset(head) if self.has_head else -1]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            # csrc/python/py_model.c's order: 13 tensors, the dense FFN (or the shared expert),
            # then each expert's FFN
            if i not in self.held_layers or (layers is not None and i not in layers):
                out += [-1] * (13 + per_ffn * (1 + cfg.num_experts))
                continue
            out += [self._offset(p + n) for n in (
                "input_layernorm.weight", "post_attention_layernorm.weight",
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                "self_attn.v_proj.bias")]
            extras = attention_extras(cfg, i)
            out += [self._offset(extras[role][0]) if role in extras else -1
                    for role in ("q_norm", "k_norm", "router", "shared_gate")]
            units = [None] + [f"e{e}" for e in range(cfg.num_experts)]
            if cfg.is_sparse_layer(i):
                units[0] = "shared"
            for unit in units:
                # experts held whole (expert parallelism) give every shard, the others none
                whole = unit not in (None, "shared") and experts is not None
                mine = shards if not whole else (
                    range(self.max_tp) if int(unit[1:]) in experts else ())
                for kind in FFN_KINDS:
                    key = kind if unit is None else f"{unit}.{kind}"
                    out += [self.shard_offset(i, key, s) if key in self.ffn[i] and s in mine
                            else -1 for s in range(self.max_tp)]
        return np.array(out, dtype=np.int64)

    def _offset(self, name):
        return self.offsets[name][0] if name in self.offsets else -1

    def read(self, name):
        """A tensor read back from the arena as float32 (a copy), as stored (o_proj transposed)."""
        offset, shape, stored = self.offsets[name]
        n = int(np.prod(shape))
        raw = self.arena.read(offset, n * DTYPES[stored][1], dtype=DTYPES[stored][0])
        if stored == "bf16":
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape).copy()
        return raw.astype(np.float32).reshape(shape)

    def read_ffn(self, layer, kind):
        """The whole (I, hidden) gate/up or down.T matrix, gathered from its shards."""
        parts = []
        storage, elem = DTYPES[self.dtype][0], DTYPES[self.dtype][1]
        for offset, rows in self.ffn[layer][kind]:
            raw = self.arena.read(offset, rows * self.config.hidden_size * elem, dtype=storage)
            if self.dtype == "bf16":
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            parts.append(raw.astype(np.float32).reshape(rows, self.config.hidden_size))
        return np.concatenate(parts)
