"""The paged KV cache with the three layouts of Gyges Table 2.

    raw     [K/V, Block, Token, Head]  vLLM's token-first layout; growing shifts every V block
    page    [Block, K/V, Token, Head]  page-friendly; growing moves nothing
    header  [Block, Head, K/V, Token]  page-friendly and header-centric; a TP worker's heads are
                                       one contiguous run per block, so migration needs no trim

Each layer lives in its own run of arena slots; blocks are numbered the same in every layer and
sequences own lists of blocks (their block tables). Everything is readable as NumPy: block tables,
a layer's storage in its physical order (`layer_raw`) and in logical order (`layer`, a strided
zero-copy view with axes (kv, block, token, head, dim) whatever the layout: Gyges'
kv_stride_order()/permute), and the K/V of a sequence gathered into (tokens, heads, head_dim).
KV bytes move between caches one way, a KVMove (below).

The values are fp32 by default (the CPU engine's); a cache in a cuda arena may hold f16 or bf16
(the CUDA engine keeps its KV in the activation dtype). Zero-copy views need host memory; gather
works on every arena and dtype (a device cache is read through the arena's copy-out path).
"""
import operator

import numpy as np

from .. import _C
from .arena import Arena
from ..core.errors import ArgumentTypeError, InvalidArgumentError

LAYOUTS = {"raw": 0, "page": 1, "header": 2}
_ALIASES = {"head": "header", "header-centric": "header", "page-friendly": "page",
            "token-first": "raw"}
LOGICAL_AXES = ("kv", "block", "token", "head", "dim")
# name -> how one value is stored (bf16 as its 16 bits)
KV_DTYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": np.dtype(np.uint16)}


def decode_values(raw, dtype):
    """Stored values (as KV_DTYPES[dtype]) -> float32; exact for every dtype."""
    if dtype == "bf16":
        return (np.asarray(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(raw).astype(np.float32)


def layout_name(layout):
    """Normalises a layout name; raises ValueError naming the choices."""
    if isinstance(layout, str):
        name = _ALIASES.get(layout, layout)
        if name in LAYOUTS:
            return name
    raise InvalidArgumentError(f"unknown KV layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def _index(value, what):
    try:
        return operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{what} must be an integer, got {type(value).__name__}") from None


class KVCache:
    """KVCache(arena, n_layers, n_kv_heads, head_dim, block_size=16, layout="header",
    first_slot=0, slots_per_layer=None, dtype="f32", first_layer=0)

    The cache holds the model's layers [first_layer, first_layer + n_layers) (a pipeline stage
    holds only its own); its layer l, as every method here numbers them, is the model's
    first_layer + l. Layer l occupies arena slots [first_slot + l*slots_per_layer, ... + slots_per_layer); by
    default the slots from first_slot to the end of the arena are shared equally by the layers.
    No memory is used until grow(pages) maps pages (the same number in every layer). `dtype` is
    how the values are stored: "f32", "f16" or "bf16".
    """

    def __init__(self, arena, n_layers, n_kv_heads, head_dim, block_size=16, layout="header",
                 first_slot=0, slots_per_layer=None, dtype="f32", first_layer=0, stack=1):
        if not isinstance(arena, Arena):
            raise ArgumentTypeError(f"arena must be a gyges.Arena, got {type(arena).__name__}")
        if dtype not in KV_DTYPES:
            raise InvalidArgumentError(f"unknown KV dtype {dtype!r}; expected one of {', '.join(KV_DTYPES)}")
        self.arena = arena
        self.value_dtype = dtype  # how values are stored; gather and write speak float32
        self.storage_dtype = KV_DTYPES[dtype]
        self.layout_name = layout_name(layout)
        n_layers, first_slot = _index(n_layers, "n_layers"), _index(first_slot, "first_slot")
        if slots_per_layer is None:
            if n_layers <= 0:
                raise InvalidArgumentError(f"n_layers must be positive, got {n_layers}")
            slots_per_layer = (arena.n_slots - first_slot) // n_layers
        self.n_layers = n_layers
        self.n_kv_heads = _index(n_kv_heads, "n_kv_heads")
        self.head_dim = _index(head_dim, "head_dim")
        self.block_size = _index(block_size, "block_size")
        self.dtype = np.dtype(np.float32)
        # The model's layers [first_layer, first_layer + n_layers): a pipeline stage's cache
        # holds its own layers only; its layer 0 is the model's first_layer.
        self.first_layer = _index(first_layer, "first_layer")
        # Layer stacking (PipeLive): pages mapped per run of `stack` layers, block b of each
        # side by side (kv_cache.h); 1 = none.
        self.stack = _index(stack, "stack")
        self._c = _C.KVCache(arena.handle, LAYOUTS[self.layout_name], n_layers, self.n_kv_heads,
                             self.head_dim, self.block_size, self.storage_dtype.itemsize,
                             first_slot, _index(slots_per_layer, "slots_per_layer"),
                             self.first_layer, self.stack)
        self.first_slot = first_slot
        self.slots_per_layer = slots_per_layer

    @property
    def handle(self):
        """The C object (gyges._C.KVCache) that engines and C models take."""
        return self._c

    def shadow(self, n_kv_heads):
        """A cache reading the same pages as blocks of n_kv_heads heads (page or header layout),
        for a layer-staggered transformation: each touches only the layers in its geometry."""
        other = object.__new__(KVCache)
        other.__dict__.update(self.__dict__)
        other._c = self._c.shadow(_index(n_kv_heads, "n_kv_heads"))
        other.n_kv_heads = n_kv_heads
        return other

    def view(self, factor):
        """Flying Serving's KV cache adaptor: a cache over this one's blocks, each read as
        factor * block_size tokens of n_kv_heads / factor heads (the same bytes), sharing this
        cache's block pool and sequences, so that requests of a TP-`factor` rank and of this
        cache live in one pool at once and a block id names one physical block in both. Creating
        it maps and copies nothing."""
        factor = _index(factor, "factor")
        other = object.__new__(KVCache)
        other.__dict__.update(self.__dict__)
        other._c = self._c.view(factor)
        other.n_kv_heads = self.n_kv_heads // factor
        other.block_size = self.block_size * factor
        return other

    def take_pages(self):
        """Ends the sharing: this shadow owns the pages, its owner is left empty."""
        self._c.take_pages()

    def unshare(self):
        """Ends the sharing the other way (a rollback): the owner keeps the pages, this shadow
        frees its sequences and is left empty."""
        self._c.unshare()

    # ---- memory ----
    def grow(self, pages):
        """Maps `pages` more pages at the end of every layer."""
        self._c.grow(_index(pages, "pages"))

    def shrink(self, pages):
        """Gives back `pages` pages from the end of every layer (their blocks must be free)."""
        self._c.shrink(_index(pages, "pages"))

    def shrinkable(self):
        """Pages per layer past the last block in use (what trim would give back)."""
        return self._c.shrinkable()

    def trim(self):
        """Gives back the pages past the last block in use (an idle cache holds none); returns
        how many per layer."""
        pages = self._c.shrinkable()
        if pages > 0:
            self._c.shrink(pages)
        return pages

    # ---- a pipeline re-split (gyges.pipelive) ----
    def set_layers(self, first_layer, end_layer):
        """Holds the model's layers [first_layer, end_layer) from now on: layers that join get
        as many pages as the others (all or none), layers that leave are unmapped; every
        sequence and block table stays. Model layer l keeps its slots whatever the range."""
        first_layer, end_layer = _index(first_layer, "first_layer"), _index(end_layer, "end_layer")
        if end_layer <= first_layer:
            raise InvalidArgumentError(f"layers [{first_layer}, {end_layer}) are empty")
        self._c.set_layers(first_layer, end_layer - first_layer)
        self.first_slot += (first_layer - self.first_layer) // self.stack * self.slots_per_layer
        self.first_layer, self.n_layers = first_layer, end_layer - first_layer

    def set_page_cap(self, pages=None):
        """Growth stops at `pages` per layer (None: the slots reserved); not below what is
        mapped."""
        self._c.set_page_cap(-1 if pages is None else _index(pages, "pages"))

    @property
    def page_cap(self):
        return self._c.page_cap()

    def compact(self, keep):
        """Moves every block in use at or past `keep` below it (bytes copied in every layer,
        block tables rewritten); returns the blocks moved."""
        return self._c.compact(_index(keep, "keep"))

    def stats(self):
        return self._c.stats()

    def layout(self):
        """The layout description: kind, sizes, strides in elements, stride order."""
        return self._c.layout()

    @property
    def n_blocks(self):
        return self._c.stats()["n_blocks"]

    @property
    def free_blocks(self):
        return self._c.stats()["free_blocks"]

    @property
    def block_bytes(self):
        return self._c.stats()["block_bytes"]

    def blocks_per_page(self):
        """Blocks of each layer a page of a run holds (a stacked page holds k layers')."""
        return self.arena.page_size / (self.block_bytes * self.stack)

    @property
    def n_runs(self):
        """Runs of pages: one per layer, one per `stack` layers when stacked."""
        return self.n_layers // self.stack

    def reshape(self, n_kv_heads):
        """Header-centric layout only: re-reads the same pages as blocks of n_kv_heads heads
        (Gyges' block reshaping); old block b becomes blocks f*b .. f*b+f-1, one per group of
        heads. Drops every sequence: the caller adopts the planned ones."""
        self._c.reshape(_index(n_kv_heads, "n_kv_heads"))
        self.n_kv_heads = n_kv_heads

    def layer_offset(self, layer):
        """Arena byte offset of the layer's storage."""
        return self._c.layer_offset(_index(layer, "layer"))

    # ---- sequences ----
    def adopt(self, blocks, n_tokens):
        """A new sequence owning exactly these (free) blocks; returns its id."""
        return self._c.seq_adopt(np.ascontiguousarray(blocks, dtype=np.int32), _index(n_tokens, "n_tokens"))

    def n_tokens(self, seq):
        return self._c.seq_n_tokens(_index(seq, "seq"))

    def new_sequence(self):
        return self._c.seq_new()

    def reserve(self, seq, n_tokens):
        """Makes room for n_tokens tokens in total; raises OutOfMemoryError (and changes
        nothing) when too few blocks are free."""
        self._c.seq_reserve(_index(seq, "seq"), _index(n_tokens, "n_tokens"))

    def free(self, seq):
        self._c.seq_free(_index(seq, "seq"))

    def free_all(self):
        """Frees every sequence (a rolled-back reconfiguration drops its shadow's)."""
        self._c.seq_free_all()

    def block_table(self, seq):
        """The sequence's block ids, as an int32 array."""
        return np.frombuffer(self._c.seq_blocks(_index(seq, "seq")), dtype=np.int32).copy()

    def block_tables(self, seqs):
        """Block tables of several sequences in CSR form: (indptr, indices, last_page_len), where
        last_page_len counts the reserved tokens in each sequence's last block."""
        tables = [self.block_table(s) for s in seqs]
        indptr = np.zeros(len(tables) + 1, dtype=np.int32)
        indptr[1:] = np.cumsum([len(t) for t in tables])
        indices = np.concatenate(tables) if tables else np.zeros(0, dtype=np.int32)
        last = np.array([(self._c.seq_n_tokens(s) - 1) % self.block_size + 1
                         if self._c.seq_n_tokens(s) > 0 else 0 for s in seqs], dtype=np.int32)
        return indptr, indices.astype(np.int32), last

    # ---- values ----
    def _tokens(self, array, what):
        array = np.ascontiguousarray(array, dtype=self.dtype)
        if array.ndim != 3 or array.shape[1:] != (self.n_kv_heads, self.head_dim):
            raise InvalidArgumentError(f"{what} must have shape (tokens, {self.n_kv_heads}, "
                             f"{self.head_dim}), got {array.shape}")
        return array

    def write(self, seq, layer, pos, k, v):
        """Stores k, v of shape (tokens, n_kv_heads, head_dim) at positions pos, pos+1, ..."""
        k, v = self._tokens(k, "k"), self._tokens(v, "v")
        if k.shape != v.shape:
            raise InvalidArgumentError(f"k and v shapes differ: {k.shape} vs {v.shape}")
        self._c.write(_index(seq, "seq"), _index(layer, "layer"), _index(pos, "pos"), k, v)

    def gather(self, seq, layer, start=0, n=None):
        """K and V of tokens [start, start+n) as two (n, n_kv_heads, head_dim) arrays (copies);
        n defaults to the sequence's reserved tokens after start."""
        seq, start = _index(seq, "seq"), _index(start, "start")
        if n is None:
            n = max(self._c.seq_n_tokens(seq) - start, 0)
        n = _index(n, "n")
        if n < 0:
            raise InvalidArgumentError(f"n must not be negative, got {n}")
        layer = _index(layer, "layer")
        if self.value_dtype != "f32" or not self.arena.host_accessible:
            return self._gather_copied(seq, layer, start, n)
        k = np.empty((n, self.n_kv_heads, self.head_dim), dtype=self.dtype)
        v = np.empty_like(k)
        self._c.gather(seq, layer, start, k, v)
        return k, v

    def _gather_copied(self, seq, layer, start, n):
        """gather() through arena.read: for device memory and 16-bit values. Each block is read
        once per K/V half, over the span its tokens and heads cover in the layout, and indexed
        with the layout's strides (the same description the kernels use)."""
        if not 0 <= layer < self.n_layers:
            raise InvalidArgumentError(f"layer {layer} is out of range [0, {self.n_layers})")
        blocks = self.block_table(seq)
        B, H, D = self.block_size, self.n_kv_heads, self.head_dim
        if start < 0 or start + n > len(blocks) * B:
            raise InvalidArgumentError(f"tokens [{start}, {start + n}) are outside the "
                                       f"{len(blocks) * B} tokens sequence {seq} has room for")
        d = self._c.layout()
        item = self.storage_dtype.itemsize
        span = (B - 1) * d["stride_token"] + (H - 1) * d["stride_head"] + D
        base = self.layer_offset(layer)
        out = np.empty((2, n, H, D), dtype=np.float32)
        for b in range(start // B, (start + n + B - 1) // B):
            lo, hi = max(start, b * B), min(start + n, (b + 1) * B)
            for kv in (0, 1):
                first = kv * d["stride_kv"] + int(blocks[b]) * d["stride_block"]
                raw = self.arena.read(base + first * item, span * item, self.storage_dtype)
                tokens = np.lib.stride_tricks.as_strided(
                    raw, shape=(B, H, D), strides=(d["stride_token"] * item,
                                                   d["stride_head"] * item, item))
                out[kv, lo - start:hi - start] = decode_values(tokens[lo - b * B:hi - b * B],
                                                               self.value_dtype)
        return out[0], out[1]

    def layer_raw(self, layer):
        """Zero-copy array over the layer's blocks in physical order (pins its pages); float32,
        float16, or bf16 as uint16 bits. Host memory only."""
        return np.frombuffer(self._c.layer_view(_index(layer, "layer")), dtype=self.storage_dtype)

    def layer(self, layer):
        """Zero-copy view of a layer with logical axes (kv, block, token, head, dim), whatever
        the layout; writes through it land in the cache."""
        raw = self.layer_raw(layer)
        d = self._c.layout()
        item = self.storage_dtype.itemsize
        shape = (2, d["n_blocks"], d["block_size"], d["n_heads"], d["head_dim"])
        strides = tuple(s * item for s in (d["stride_kv"], d["stride_block"], d["stride_token"],
                                           d["stride_head"], 1))
        return np.lib.stride_tricks.as_strided(raw, shape=shape, strides=strides)

    def __repr__(self):
        s = self._c.stats()
        return (f"KVCache(layout={self.layout_name!r}, dtype={self.value_dtype!r}, "
                f"layers={self.n_layers}, "
                f"kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"block_size={self.block_size}, blocks={s['n_blocks']}, free={s['free_blocks']})")


class KVMove:
    """A move of KV bytes between caches, the only way they move (csrc/kv/kv_move.h): items
    added with add(), over model layers `layers`, run by run(); wherever the caches live (memmove
    in host memory, the head-copy kernel on a GPU both share).

        KVMove(range(L)).add(src, dst, src_blocks=old, dst_blocks=new, src_head=2, n_heads=2).run()

    An item pairs blocks of `src` with blocks of `dst`: two lists of block ids, or the block
    tables of sequences src_seq and dst_seq; and copies heads [src_head, src_head + n_heads) of
    every paired block (K and V, token slots [0, n_tokens) of the pairs in order, every slot
    when n_tokens is None) to heads [dst_head, ...) of its partner, in every layer of `layers`.
    Options of the same call:
      dirty      uint64 words a KVDirty.take filled (dirty_slots: the bitmap's slots, by default
                 64 a word): only those slots of the one source cache are copied (a patch);
      overlap    destinations may lie over sources (a shadow cache over the same pages): every
                 source is read before anything is written; host caches only. An overlap move
                 may be read early: plan(stage) between steps, stage.read() beside a step, then
                 run(stage) with the move as it is by then (KVMoveStage);
      threads    1 or 2, for overlap moves;
      comm       a communicator (gyges._C.Comm, a group's migration one: CommPool.migration)
                 whose ranks' GPUs hold the caches: caches on several GPUs move over it, by one
                 all-to-all per layer (the comm backend, csrc/comm/kv_move_comm.h); ignored when
                 every cache is in one memory.
    run() refuses, copying nothing, what does not fit (blocks not mapped, heads or layers out of
    range, caches on different devices without a communicator joining them) and returns its
    stats: "slots" (asked for per layer), "bytes" (written, every layer), "bytes_in_place",
    "bytes_early", "bytes_late", "items_reused", "items_stale", "stage_bytes", "runs_direct",
    "runs_parked", "backend", and for the comm backend "comm_bytes" (sent between GPUs) and
    "staging_bytes" (the most device memory one rank staged)."""

    def __init__(self, layers, items=(), dirty=None, dirty_slots=None, overlap=False, threads=1,
                 comm=None):
        if not isinstance(layers, range) or layers.step != 1:
            raise InvalidArgumentError(f"layers must be a range with step 1, got {layers!r}")
        self.layers = layers
        self.items = list(items)  # KVMove.item tuples
        self._options = {"overlap": bool(overlap), "threads": _index(threads, "threads")}
        if comm is not None:
            if not isinstance(comm, _C.Comm):
                raise ArgumentTypeError(f"comm must be a communicator (gyges._C.Comm), got "
                                        f"{type(comm).__name__}")
            self._options["comm"] = comm
        if dirty is not None:
            dirty = np.ascontiguousarray(dirty, dtype=np.uint64)
            slots = 64 * dirty.size if dirty_slots is None else _index(dirty_slots, "dirty_slots")
            self._options.update(dirty=dirty, dirty_slots=slots)

    @staticmethod
    def item(src, dst, src_blocks=None, dst_blocks=None, *, src_seq=None, dst_seq=None,
             src_head=0, dst_head=0, n_heads=None, n_tokens=None):
        """One item, checked (see the class): add() appends one, the constructor takes a list
        (the same items move several layers, one move each)."""
        for name, kv in (("src", src), ("dst", dst)):
            if not isinstance(kv, KVCache):
                raise ArgumentTypeError(f"{name} must be a gyges.KVCache, got {type(kv).__name__}")
        if (src_blocks is None) != (dst_blocks is None) or (src_blocks is None) == (src_seq is None):
            raise InvalidArgumentError("an item pairs two block lists or two sequences")
        if src_blocks is not None:
            src_blocks = np.ascontiguousarray(src_blocks, dtype=np.int32).ravel()
            dst_blocks = np.ascontiguousarray(dst_blocks, dtype=np.int32).ravel()
            if dst_blocks.size != src_blocks.size:
                raise InvalidArgumentError(f"{dst_blocks.size} destination blocks for "
                                           f"{src_blocks.size} sources")
            src_seq = dst_seq = -1
        elif dst_seq is None:
            raise InvalidArgumentError("an item of sequences names both")
        src_head = _index(src_head, "src_head")
        n_heads = src.n_kv_heads - src_head if n_heads is None else _index(n_heads, "n_heads")
        return (src._c, dst._c, src_blocks, dst_blocks, _index(src_seq, "src_seq"),
                _index(dst_seq, "dst_seq"), src_head, _index(dst_head, "dst_head"), n_heads,
                -1 if n_tokens is None else _index(n_tokens, "n_tokens"))

    def add(self, src, dst, src_blocks=None, dst_blocks=None, **kwargs):
        """Appends an item (KVMove.item's arguments); returns the move."""
        self.items.append(self.item(src, dst, src_blocks, dst_blocks, **kwargs))
        return self

    def run(self, stage=None):
        """Copies everything (GIL released); returns the stats. With `stage` (a KVMoveStage),
        an overlap move reads through it and uses its early read of these layers, if any."""
        if stage is not None and not isinstance(stage, KVMoveStage):
            raise ArgumentTypeError(f"stage must be a gyges.KVMoveStage, got {type(stage).__name__}")
        return _C.kv_move(self.items, self.layers.start, self.layers.stop,
                          stage=None if stage is None else stage._c, **self._options)

    def plan(self, stage):
        """The early read's first half, between steps: `stage` remembers this overlap move's
        blocks (items of sequences with token counts), and stage.read() copies them."""
        if not isinstance(stage, KVMoveStage):
            raise ArgumentTypeError(f"stage must be a gyges.KVMoveStage, got {type(stage).__name__}")
        stage._c.plan(self.items, self.layers.start, self.layers.stop, **self._options)


class KVMoveStage:
    """The host memory overlap moves read through, kept between them (it grows to the largest),
    and an early read: KVMove.plan(stage) between steps, read() on any thread while a step runs,
    then a KVMove.run(stage) of the move as it is by then reuses what was read."""

    def __init__(self):
        self._c = _C.KVMoveStage()

    def read(self):
        """Copies the planned tokens into the stage (GIL released); no-op without a plan."""
        self._c.read()
