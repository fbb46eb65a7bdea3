"""A worker: one arena (its "GPU"), the model weights placed in it, a paged KV cache for the KV
heads it holds, and the C model that runs forward passes on them.

An Engine has one worker; a Host has several, grouped into tensor-parallel instances.

backend="cpu" keeps everything in host memory and runs the CPU kernels (fp32 activations and KV).
backend="cuda" puts the arena on GPU `device` (its pages are device memory, 2 MiB by default, the
driver's granularity), writes the weights through the arena's copy-in path, keeps the KV cache in
the weight dtype and runs the CUDA forward pass on the worker's own stream; several workers may
share one GPU (each has its arena, stream and cuBLAS handle).
"""
import numpy as np

from .. import _C
from .arena import BACKENDS, Arena
from ..core import checks
from ..core.checks import INT32_MAX
from ..core.errors import InvalidArgumentError, OutOfMemoryError, UnavailableError
from .kv_cache import KVCache, layout_name
from ..core.units import format_size, parse_size
from ..models.rope import rope_frequencies
from .weights import DTYPES, ModelWeights, WeightPages

WEIGHT_DTYPE_IDS = {"f32": 0, "f16": 1, "bf16": 2}
DEFAULT_PAGE_SIZE = {"cpu": "64KiB", "cuda": "2MiB"}
# A budget left to its default holds the whole model (a worker may serve it alone, at TP1) and KV
# for this many tokens (SmolLM2-135M: 8192 tokens of fp32 KV are 360 MiB beside 515 MiB of
# weights), and never less than the floor, the budget that tiny test models were sized with.
DEFAULT_KV_TOKENS = 8192
MEMORY_FLOOR = {"cpu": "64MiB", "cuda": "256MiB"}


def default_kv_dtype(backend, weight_dtype):
    """The CPU kernels keep fp32 KV; the CUDA ones the activation (= weight) dtype."""
    return "f32" if backend == "cpu" else weight_dtype


def model_memory(model, backend="cpu", weight_dtype=None, max_tp=None, page_size=None,
                 pad_ffn=True, kv_tokens=DEFAULT_KV_TOKENS):
    """The bytes a worker needs for the whole model's weights laid out in its pages and for the KV
    of `kv_tokens` tokens (every layer, all KV heads), its pages rounded per layer."""
    config = model.config
    weight_dtype = weight_dtype or getattr(model, "weight_dtype", "f32")
    max_tp = default_max_tp(config) if max_tp is None else max_tp
    page = parse_size(page_size or DEFAULT_PAGE_SIZE[backend], "page_size", lo=1)
    weights = WeightPages(config, model.tensors, weight_dtype, max_tp, page, pad_ffn).bytes
    kv_elem = DTYPES[default_kv_dtype(backend, weight_dtype)][1]
    kv = -(-config.kv_bytes_per_token(kv_elem) * kv_tokens // page) * page
    return weights + kv + 2 * config.num_hidden_layers * page


def default_memory(model, backend="cpu", floor=None, **layout):
    """A worker's default budget: model_memory(...), at least `floor` (the backend's floor)."""
    return max(model_memory(model, backend, **layout),
               parse_size(floor or MEMORY_FLOOR[backend], "floor"))


def cuda_device_unavailable():
    """Why no CUDA device can be used (None when one can): gyges built without CUDA, or no
    driver or device. What the GPU tests and benchmarks skip with."""
    if not _C.WITH_CUDA:
        return ("gyges was built without CUDA (nvcc was not found at build time, or "
                "GYGES_CUDA=0)")
    if _C.cuda_device_count() == 0:
        return "no CUDA driver or device on this machine"
    return None


def cuda_unavailable():
    """Why backend="cuda" cannot run on this machine and build (None when it can): no usable
    device (cuda_device_unavailable), or a build without the CUDA forward pass's kernels."""
    return cuda_device_unavailable() or _C.cuda_forward_unavailable()


def _divides_model(config, tp):
    return not (config.num_attention_heads % tp or config.num_key_value_heads % tp
                or config.intermediate_size % tp or config.moe_intermediate_size % tp
                or config.shared_expert_intermediate_size % tp)


def default_max_tp(config, limit=4):
    """How many FFN shards (and o_proj chunks) the model is cut into: the largest power of two up
    to `limit` dividing the heads, KV heads and FFN width; where that is 1, the largest other such
    divisor (SmolLM2's 3 KV heads: 3), so that the model has a TP group at all."""
    tp = 1
    while tp * 2 <= limit and _divides_model(config, tp * 2):
        tp *= 2
    if tp == 1:
        tp = max(t for t in range(1, limit + 1) if _divides_model(config, t))
    return tp


def tp_degrees(config, max_tp):
    """The TP degrees a model cut into max_tp shards runs at, bit-identically to TP1: each divides
    the heads and KV heads and leaves each rank a power of two of shards, or all of them
    (csrc/core/tree.h): 1, 2, 4 for max_tp 4; 1 and 3 for SmolLM2."""
    return [t for t in range(1, max_tp + 1) if max_tp % t == 0 and _divides_model(config, t)
            and (t == 1 or (max_tp // t) & (max_tp // t - 1) == 0)]


class Worker:
    def __init__(self, model, memory=None, page_size=None, block_size=16,
                 kv_layout="header", weight_dtype=None, max_tp=None, threads=2, max_pos=None,
                 backend="cpu", pad_ffn=True, tp_size=1, tp_rank=0, device=0, kv_dtype=None,
                 kv_stack=1, memory_name="memory", memory_floor=None, expert_parallel=False):
        config = model.config
        if weight_dtype is None:  # the dtype the model was loaded in
            weight_dtype = getattr(model, "weight_dtype", "f32")
        if backend not in BACKENDS:
            raise InvalidArgumentError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
        if weight_dtype not in DTYPES:
            raise InvalidArgumentError(f"unknown weight dtype {weight_dtype!r}; expected one of "
                             f"{', '.join(DTYPES)}")
        # The CPU kernels keep fp32 KV; the CUDA ones the activation (= weight) dtype, or fp32.
        kv_dtype = kv_dtype or default_kv_dtype(backend, weight_dtype)
        if kv_dtype not in ("f32", weight_dtype) or (backend == "cpu" and kv_dtype != "f32"):
            raise InvalidArgumentError(f"kv_dtype {kv_dtype!r} does not fit the {backend} backend with "
                             f"{weight_dtype} weights (use f32" +
                             (f" or {weight_dtype})" if backend == "cuda" else ")"))
        self.config = config
        if expert_parallel and not config.is_moe:
            raise InvalidArgumentError(f"expert_parallel=True needs a mixture-of-experts model, "
                                       f"not {config.model_type}")
        if expert_parallel and not pad_ffn:
            raise InvalidArgumentError("expert_parallel=True drops experts by their pages: it "
                                       "needs pad_ffn=True")
        # Expert parallelism: as rank r of a TP group of t, hold experts [r*E/t, (r+1)*E/t)
        # whole instead of every expert's TP shards (csrc/engine/model.h)
        self.expert_parallel = bool(expert_parallel)
        max_tp = default_max_tp(config) if max_tp is None else max_tp
        self.max_tp = max_tp
        self.backend, self.kv_dtype = backend, kv_dtype
        self.page_size = parse_size(page_size or DEFAULT_PAGE_SIZE[backend], "page_size", lo=1)
        layout = dict(weight_dtype=weight_dtype, max_tp=max_tp, page_size=self.page_size,
                      pad_ffn=pad_ffn)
        budget = (default_memory(model, backend, memory_floor, **layout) if memory is None
                  else parse_size(memory, memory_name))
        budget -= budget % self.page_size
        # A worker's memory is its device's: on the cpu backend a released page keeps its memory
        # for the next creation (the arena's pool), so that dropping a layer's FFN shards in a
        # transformation does not pay the kernel for freeing them on the serving path. The budget
        # counts the page free at once. (The cuda pool creates its handles at start-up; it is not
        # sized for workers until that is measured on a GPU.)
        pool = budget // self.page_size if backend == "cpu" else 0
        self.arena = Arena(budget=budget, page_size=self.page_size, backend=backend, device=device,
                           n_slots=8 * max(budget // self.page_size, 1), pool_pages=pool)
        if backend == "cuda" and _C.cuda_forward_unavailable():
            # Refused before the weights are copied in, with the build's reason.
            raise UnavailableError(_C.cuda_forward_unavailable())
        self.device = self.arena.device
        weights = WeightPages(config, model.tensors, weight_dtype, max_tp, self.page_size, pad_ffn)
        if weights.bytes > budget:  # said in the caller's words, before a weight is copied
            fits = -(-model_memory(model, backend, **layout) // (1 << 20)) << 20
            raise OutOfMemoryError(
                f"{memory_name}={format_size(budget)} cannot hold the weights "
                f"({weights.bytes / (1 << 20):.1f} MiB in pages of {format_size(self.page_size)}); "
                f"{memory_name}='{format_size(fits)}' holds them and the KV of "
                f"{DEFAULT_KV_TOKENS} tokens (None sizes it so)")
        # The rotary frequencies, scaled as the config says: data for both backends.
        self.rope_inv_freq, self.rope_mscale = rope_frequencies(config)
        self.weights = ModelWeights(self.arena, config, model.tensors, dtype=weight_dtype,
                                    max_tp=max_tp, pad=pad_ffn)
        if expert_parallel:
            self.weights.hold_experts_whole()
        self.weights_bytes = self.arena.stats()["bytes_in_use"]
        self.max_pos = (config.max_position_embeddings if max_pos is None else
                        checks.integer("max_pos", max_pos, lo=1, hi=INT32_MAX))
        # A CUDA worker has no use for CPU threads: its work is on its stream.
        self.threads, self.weight_dtype = (threads if backend == "cpu" else 1), weight_dtype
        self.block_size, self.kv_layout = block_size, layout_name(kv_layout)
        if not isinstance(kv_stack, int) or kv_stack < 1 or config.num_hidden_layers % kv_stack:
            raise InvalidArgumentError(f"kv_stack must be a positive divisor of the model's "
                                       f"{config.num_hidden_layers} layers, got {kv_stack!r}")
        self.kv_stack = kv_stack
        self.tp_size, self.tp_rank = 1, 0
        self.layers = (0, config.num_hidden_layers)  # the layers its KV cache holds
        self.kv = self.new_kv(1)
        self.c_model = self._new_c_model()
        if tp_size > 1:
            self.join_tp(tp_size, tp_rank)

    def new_kv(self, tp_size, region=0):
        """A KV cache for the KV heads of one TP rank in one of two slot regions: a copying
        transformation (the `basic` baseline) builds the new cache in the other region while the
        old one still holds its data."""
        config = self.config
        first = self.weights.end_slot
        k = self.kv_stack
        runs = config.num_hidden_layers // k
        # Slots for every run of k model layers (k = 1: every layer), whichever the worker holds:
        # model layer l always lives at the same slots, so a pipeline re-split can add layers
        # next to the ones held (KVCache.set_layers).
        per_run = (self.arena.n_slots - first) // (2 * runs)
        self.kv_region = region
        return KVCache(self.arena, n_layers=self.layers[1] - self.layers[0],
                       n_kv_heads=config.num_key_value_heads // tp_size, head_dim=config.head_dim,
                       block_size=self.block_size, layout=self.kv_layout,
                       first_slot=first + (region * runs + self.layers[0] // k) * per_run,
                       slots_per_layer=per_run, dtype=self.kv_dtype, first_layer=self.layers[0],
                       stack=k)

    def _new_c_model(self, shards=None, pending=False, layers=None, experts=None):
        config = self.config
        spec = (config.vocab_size, config.hidden_size, config.intermediate_size,
                config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                config.head_dim, self.max_tp, self.max_pos, WEIGHT_DTYPE_IDS[self.weight_dtype],
                float(config.rms_norm_eps))
        if shards is None:
            shards = self.weights.held
        elif not pending:
            shards = set(shards) & self.weights.held
        mask = sum(1 << s for s in shards)
        w = self.weights
        held = sorted(w.held_layers if layers is None else set(range(*layers)) & w.held_layers)
        layers = (held[0], held[-1] + 1) if held else (0, 0)
        if len(held) != layers[1] - layers[0]:
            raise InvalidArgumentError(f"the worker holds layers {held}, not a range")
        experts = w.held_experts if experts is None else set(experts)
        return _C.Model(self.arena.handle, spec,
                        w.c_offsets(shards, pending, set(held), experts), mask,
                        self.threads, getattr(self, "c_model", None),  # its rotary tables
                        layers=layers, embed=w.has_embed, head=w.has_head,
                        rope_inv_freq=self.rope_inv_freq, rope_mscale=self.rope_mscale,
                        n_experts=config.num_experts, experts_used=config.num_experts_per_tok,
                        expert_intermediate=config.moe_intermediate_size,
                        shared_intermediate=config.shared_expert_intermediate_size,
                        norm_topk_prob=config.norm_topk_prob,
                        experts=self._expert_range(experts))

    def model_for_layers(self, first, end):
        """A C model over layers [first, end) of those held (a pipeline re-split's target stage,
        made while the worker still holds the layers it is about to give up)."""
        return self._new_c_model(layers=(first, end))

    def model_for_rank(self, tp_size, tp_rank, pending=False):
        """A C model over the FFN shards (and, expert-parallel, the experts) of rank tp_rank of
        a TP group of tp_size: the model of a future TP position; pending=True allows shards
        and experts that are mapped later, before a layer using them runs."""
        return self._new_c_model(self.owned_shards(tp_size, tp_rank), pending,
                                 experts=self.owned_experts(tp_size, tp_rank))

    def owned_experts(self, tp_size, tp_rank):
        """The experts rank tp_rank of an expert-parallel TP group holds whole (all of them at
        TP1); None when experts are TP-sharded like the dense FFN."""
        if not self.expert_parallel:
            return None
        n = self.config.num_experts
        return set(range(tp_rank * n // tp_size, (tp_rank + 1) * n // tp_size))

    def _expert_range(self, experts):
        """(begin, end) of `experts`, held whole, for the C model; None for every expert (TP1)
        or experts sharded like the dense FFN."""
        if experts is None or len(experts) == self.config.num_experts:
            return None
        return (min(experts), max(experts) + 1)

    def experts_held(self):
        """(begin, end) of the experts the C model holds whole, or None: every expert."""
        return self._expert_range(self.weights.held_experts)

    def owned_shards(self, tp_size, tp_rank):
        per = self.max_tp // tp_size
        return set(range(tp_rank * per, (tp_rank + 1) * per))

    def join_tp(self, tp_size, tp_rank):
        """Becomes rank tp_rank of a TP group (while it holds no KV): keeps only its FFN shards,
        and its KV cache holds only its KV heads."""
        config = self.config
        if config.num_key_value_heads % tp_size or self.max_tp % tp_size:
            raise InvalidArgumentError(f"TP{tp_size} does not divide {config.num_key_value_heads} KV heads "
                             f"and {self.max_tp} FFN shards")
        if self.kv.stats()["n_sequences"]:
            raise InvalidArgumentError("the worker still holds requests; transform it instead")
        if self.expert_parallel:
            if tp_size > self.config.num_experts:
                raise InvalidArgumentError(f"TP{tp_size} with expert parallelism leaves a rank "
                                           f"none of the {self.config.num_experts} experts")
            self.weights.drop_experts(self.owned_experts(tp_size, tp_rank))
        if self.weights.pad:
            self.weights.drop_shards(self.owned_shards(tp_size, tp_rank))
        else:
            self.weights.partial_swap(self.owned_shards(tp_size, tp_rank))
        if self.kv.n_blocks:
            self.kv.shrink(self.kv.stats()["pages_per_layer"])
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.kv = self.new_kv(tp_size)
        self.c_model = self._new_c_model()

    def join_stage(self, first, end, weights_from=None):
        """Becomes a pipeline stage running layers [first, end) (while it holds no KV): it keeps
        those layers' weights, the embedding when it is the first stage and the head when the
        last (with the embedding too when the LM head is tied to it), and gives the rest back;
        layers it lacks come from the peer Worker `weights_from` or the host copy. Its KV cache
        holds its layers only."""
        n = self.config.num_hidden_layers
        if not 0 <= first < end <= n:
            raise InvalidArgumentError(f"a stage runs layers [first, end) within [0, {n}), got "
                                       f"[{first}, {end})")
        if self.kv.stats()["n_sequences"]:
            raise InvalidArgumentError("the worker still holds requests; it cannot change layers")
        if self.kv.n_blocks:
            self.kv.shrink(self.kv.stats()["pages_per_layer"])
        peer = weights_from.weights if weights_from is not None else None
        w = self.weights
        w.restore_layers(set(range(first, end)) - w.held_layers, peer)
        w.drop_layers(w.held_layers - set(range(first, end)))
        w.set_ends(embed=first == 0 or (end == n and self.config.tie_word_embeddings),
                   head=end == n, source=peer)
        self.layers = (first, end)
        self.kv = self.new_kv(self.tp_size)
        self.c_model = self._new_c_model()

    def kv_pages_free(self):
        """Pages of the budget not in use, as whole KV pages across the cache's layers."""
        s = self.arena.stats()
        return (s["budget_bytes"] - s["bytes_in_use"]) // self.page_size // self.kv.n_runs

    def forward(self, tokens, token_seq, token_pos, block_tables, logit_rows):
        """One forward pass (TP1) over tokens of several sequences; returns the logits of
        logit_rows. block_tables: list of int32 arrays, indexed by token_seq."""
        i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)
        indptr = np.zeros(len(block_tables) + 1, dtype=np.int32)
        indptr[1:] = np.cumsum([len(t) for t in block_tables])
        indices = i32(np.concatenate(block_tables)) if block_tables else np.zeros(0, np.int32)
        rows = i32(logit_rows)
        logits = np.empty((len(rows), self.config.vocab_size), dtype=np.float32)
        self.c_model.forward(self.kv.handle, i32(tokens), i32(token_seq), i32(token_pos), indptr,
                             indices, rows, logits)
        return logits

    def checkpoint(self):
        """What a reconfiguration may change of this worker, to come back to (restore)."""
        return {"kv": self.kv, "c_model": self.c_model, "tp": (self.tp_size, self.tp_rank),
                "layers": self.layers, "weights": self.weights.checkpoint()}

    def restore(self, cp):
        """Back to a checkpoint: its weights as they were (what was dropped filled again from
        the host copy), its KV cache object, C model, TP position and layers."""
        self.weights.rollback(cp["weights"])
        self.kv, self.c_model = cp["kv"], cp["c_model"]
        self.tp_size, self.tp_rank = cp["tp"]
        self.layers = cp["layers"]

    def install(self, kv=None, c_model=None, tp=None):
        """Takes a transformation's result: a new KV cache, C model and/or (tp_size, tp_rank)."""
        if kv is not None:
            self.kv = kv
        if c_model is not None:
            self.c_model = c_model
        if tp is not None:
            self.tp_size, self.tp_rank = tp

    def set_layers(self, first, end, c_model=None):
        """Records the layers [first, end) the worker serves after a pipeline re-split or a buddy
        group changed the weights and KV it holds; the C model is rebuilt over them unless one
        made for them is given."""
        self.layers = (first, end)
        self.c_model = c_model if c_model is not None else self.model_for_layers(first, end)

    def set_tp(self, tp_size, tp_rank):
        """Records a new TP position after a transformation changed the weights and KV it holds;
        the C model is rebuilt over the shards now held."""
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.c_model = self._new_c_model()
