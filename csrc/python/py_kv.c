/* py_kv.c: gyges._C.KVCache, a paged KV cache in an Arena. gyges/kv_cache.py checks arguments
 * and builds the NumPy arrays; this file only moves bytes and translates statuses. */
#include "py_common.h"

#include "kv/kv_cache.h"

typedef struct {
    PyObject_HEAD
    PyObject *arena_object; /* strong: the cache's pages live there */
    PyObject *base_object;  /* strong, for a view: the cache whose pool it shares */
    gy_kv_cache *kv;
} GyKVObject;

static PyObject *gy_py_kv_type;

static PyObject *gy_py_kv_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"arena", "layout", "n_layers", "n_heads", "head_dim", "block_size",
                            "elem_size", "first_slot", "slots_per_layer", "first_layer", "stack",
                            NULL};
    PyObject *arena_object;
    int layout;
    long long n_layers, n_heads, head_dim, block_size, elem_size, first_slot, slots_per_layer;
    long long first_layer = 0, stack = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OiLLLLLLL|LL", names, &arena_object, &layout,
                                     &n_layers, &n_heads, &head_dim, &block_size, &elem_size,
                                     &first_slot, &slots_per_layer, &first_layer, &stack))
        return NULL;
    gy_arena *arena = gy_py_arena_unwrap(arena_object);
    if (arena == NULL) return NULL;
    gy_kv_config config = {
        .layout = (gy_kv_layout_kind)layout,
        .n_layers = n_layers,
        .first_layer = first_layer,
        .n_heads = n_heads,
        .head_dim = head_dim,
        .block_size = block_size,
        .elem_size = elem_size,
        .first_slot = first_slot,
        .slots_per_layer = slots_per_layer,
        .stack = stack,
    };
    gy_kv_cache *kv = NULL;
    gy_status s = gy_kv_init(&kv, arena, &config);
    if (s != GY_OK) return gy_py_raise(s);
    GyKVObject *self = (GyKVObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        gy_kv_free(kv);
        return NULL;
    }
    self->arena_object = Py_NewRef(arena_object);
    self->kv = kv;
    return (PyObject *)self;
}

static void gy_py_kv_dealloc(GyKVObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_kv_free(self->kv);
    Py_XDECREF(self->base_object); /* after the view: a base outlives its views */
    Py_XDECREF(self->arena_object);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

#define GY_PY_KV_CALL(call)                                                                        \
    do {                                                                                           \
        gy_status s_;                                                                              \
        Py_BEGIN_ALLOW_THREADS                                                                     \
        s_ = (call);                                                                               \
        Py_END_ALLOW_THREADS                                                                       \
        if (s_ != GY_OK) return gy_py_raise(s_);                                                   \
    } while (0)

static PyObject *gy_py_kv_grow(GyKVObject *self, PyObject *args) {
    long long pages;
    if (!PyArg_ParseTuple(args, "L", &pages)) return NULL;
    GY_PY_KV_CALL(gy_kv_grow(self->kv, pages));
    Py_RETURN_NONE;
}

static PyObject *gy_py_kv_shrink(GyKVObject *self, PyObject *args) {
    long long pages;
    if (!PyArg_ParseTuple(args, "L", &pages)) return NULL;
    GY_PY_KV_CALL(gy_kv_shrink(self->kv, pages));
    Py_RETURN_NONE;
}

static PyObject *gy_py_kv_shrinkable(GyKVObject *self, PyObject *unused) {
    return PyLong_FromLongLong(gy_kv_shrinkable_pages(self->kv));
}

static PyObject *gy_py_kv_seq_new(GyKVObject *self, PyObject *unused) {
    int64_t seq;
    gy_status s = gy_kv_seq_new(self->kv, &seq);
    if (s != GY_OK) return gy_py_raise(s);
    return PyLong_FromLongLong(seq);
}

static PyObject *gy_py_kv_seq_reserve(GyKVObject *self, PyObject *args) {
    long long seq, n_tokens;
    if (!PyArg_ParseTuple(args, "LL", &seq, &n_tokens)) return NULL;
    gy_status s = gy_kv_seq_reserve(self->kv, seq, n_tokens);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_kv_seq_free(GyKVObject *self, PyObject *args) {
    long long seq;
    if (!PyArg_ParseTuple(args, "L", &seq)) return NULL;
    gy_status s = gy_kv_seq_free(self->kv, seq);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_kv_unshare(GyKVObject *self, PyObject *unused) {
    gy_kv_unshare(self->kv);
    Py_RETURN_NONE;
}

static PyObject *gy_py_kv_seq_free_all(GyKVObject *self, PyObject *unused) {
    gy_kv_seq_free_all(self->kv);
    Py_RETURN_NONE;
}

/* seq_blocks(seq) -> bytes holding the block ids as int32. */
static PyObject *gy_py_kv_seq_blocks(GyKVObject *self, PyObject *args) {
    long long seq;
    if (!PyArg_ParseTuple(args, "L", &seq)) return NULL;
    const int64_t n = gy_kv_seq_n_blocks(self->kv, seq);
    if (n < 0) {
        PyErr_Format(gy_py_error_class(GY_ERR_STATE), "sequence %lld does not exist", seq);
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)gy_kv_seq_blocks(self->kv, seq),
                                     (Py_ssize_t)(n * (int64_t)sizeof(int32_t)));
}

static PyObject *gy_py_kv_seq_n_tokens(GyKVObject *self, PyObject *args) {
    long long seq;
    if (!PyArg_ParseTuple(args, "L", &seq)) return NULL;
    return PyLong_FromLongLong(gy_kv_seq_n_tokens(self->kv, seq));
}

/* write(seq, layer, pos, k, v) with k, v float32 (n, n_heads, head_dim) buffers;
 * gather(seq, layer, pos, k_out, v_out) likewise, n taken from the buffers. */
static PyObject *gy_py_kv_transfer(GyKVObject *self, PyObject *args, int writing) {
    long long seq, layer, pos;
    PyObject *k_object, *v_object;
    if (!PyArg_ParseTuple(args, "LLLOO", &seq, &layer, &pos, &k_object, &v_object)) return NULL;
    const gy_kv_config *c = gy_kv_config_of(self->kv);
    const Py_ssize_t token_bytes = (Py_ssize_t)(c->n_heads * c->head_dim * (int64_t)sizeof(float));
    Py_buffer k, v;
    if (PyObject_GetBuffer(k_object, &k, PyBUF_C_CONTIGUOUS | (writing ? 0 : PyBUF_WRITABLE)) < 0)
        return NULL;
    if (k.len % token_bytes != 0) {
        PyBuffer_Release(&k);
        return PyErr_Format(GY_PY_VALUE_ERROR, "K buffer of %zd bytes is not a whole number of tokens", k.len);
    }
    if (gy_py_get_buffer(v_object, &v, k.len, !writing, "V buffer") < 0) {
        PyBuffer_Release(&k);
        return NULL;
    }
    const int64_t n = (int64_t)(k.len / token_bytes);
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = writing ? gy_kv_write(self->kv, seq, layer, pos, n, k.buf, v.buf)
                : gy_kv_gather(self->kv, seq, layer, pos, n, k.buf, v.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_kv_write(GyKVObject *self, PyObject *args) { return gy_py_kv_transfer(self, args, 1); }
static PyObject *gy_py_kv_gather(GyKVObject *self, PyObject *args) { return gy_py_kv_transfer(self, args, 0); }

static PyObject *gy_py_kv_stats(GyKVObject *self, PyObject *unused) {
    gy_kv_stats st;
    gy_kv_stats_get(self->kv, &st);
    return Py_BuildValue("{sLsLsLsLsKsKsKsK}", "n_blocks", (long long)st.n_blocks, "free_blocks",
                         (long long)st.free_blocks, "pages_per_layer", (long long)st.pages_per_layer,
                         "n_sequences", (long long)st.n_sequences, "block_bytes", st.block_bytes,
                         "bytes_moved", st.bytes_moved, "grows", st.grows, "shrinks", st.shrinks);
}

/* The layout description, strides in elements, for the NumPy views and the tests. */
static PyObject *gy_py_kv_layout(GyKVObject *self, PyObject *unused) {
    const gy_kv_layout *L = gy_kv_layout_of(self->kv);
    int32_t order[GY_KV_DIM_COUNT];
    gy_kv_layout_stride_order((gy_kv_layout_kind)L->kind, order);
    return Py_BuildValue("{sisLsLsLsLsLsLsLsLsLsLs(iiii)}", "kind", (int)L->kind, "block_size",
                         (long long)L->block_size, "n_heads", (long long)L->n_heads, "head_dim",
                         (long long)L->head_dim, "n_blocks", (long long)L->n_blocks, "elem_size",
                         (long long)L->elem_size, "stride_kv", (long long)L->stride_kv,
                         "stride_block", (long long)L->stride_block, "stride_token",
                         (long long)L->stride_token, "stride_head", (long long)L->stride_head,
                         "block_elems", (long long)L->block_elems, "stride_order", order[0],
                         order[1], order[2], order[3]);
}

static PyObject *gy_py_kv_layer_offset(GyKVObject *self, PyObject *args) {
    long long layer;
    if (!PyArg_ParseTuple(args, "L", &layer)) return NULL;
    if (layer < 0 || layer >= gy_kv_config_of(self->kv)->n_layers)
        return PyErr_Format(GY_PY_VALUE_ERROR, "layer %lld is out of range", layer);
    return PyLong_FromUnsignedLongLong(gy_kv_layer_offset(self->kv, layer));
}

/* layer_view(layer) -> ArenaView over the layer's blocks; pins its pages and keeps the cache
 * alive. */
static PyObject *gy_py_kv_layer_view(GyKVObject *self, PyObject *args) {
    long long layer;
    if (!PyArg_ParseTuple(args, "L", &layer)) return NULL;
    if (layer < 0 || layer >= gy_kv_config_of(self->kv)->n_layers)
        return PyErr_Format(GY_PY_VALUE_ERROR, "layer %lld is out of range", layer);
    gy_kv_stats st;
    gy_kv_stats_get(self->kv, &st);
    if (st.n_blocks == 0)
        return PyErr_Format(gy_py_error_class(GY_ERR_STATE), "the KV cache has no blocks yet; grow it first");
    /* a stacked layer's blocks are k blocks apart: the view ends at its last block's end */
    const uint64_t row = st.block_bytes * (uint64_t)gy_kv_stack(self->kv);
    return gy_py_arena_view_new(self->arena_object, (PyObject *)self,
                                gy_kv_layer_offset(self->kv, layer),
                                (uint64_t)(st.n_blocks - 1) * row + st.block_bytes, 0);
}

static PyObject *gy_py_kv_reshape(GyKVObject *self, PyObject *args) {
    long long heads;
    if (!PyArg_ParseTuple(args, "L", &heads)) return NULL;
    gy_status s = gy_kv_reshape(self->kv, heads);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

/* seq_adopt(blocks_int32, n_tokens) -> seq */
static PyObject *gy_py_kv_seq_adopt(GyKVObject *self, PyObject *args) {
    PyObject *blocks_object;
    long long n_tokens;
    if (!PyArg_ParseTuple(args, "OL", &blocks_object, &n_tokens)) return NULL;
    Py_buffer blocks;
    if (PyObject_GetBuffer(blocks_object, &blocks, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int64_t seq;
    gy_status s = gy_kv_seq_adopt(self->kv, blocks.buf, blocks.len / 4, n_tokens, &seq);
    PyBuffer_Release(&blocks);
    if (s != GY_OK) return gy_py_raise(s);
    return PyLong_FromLongLong(seq);
}

/* shadow(n_heads) -> a KVCache reading this cache's pages as blocks of n_heads heads */
static PyObject *gy_py_kv_shadow(GyKVObject *self, PyObject *args) {
    long long heads;
    if (!PyArg_ParseTuple(args, "L", &heads)) return NULL;
    gy_kv_cache *kv;
    gy_status s = gy_kv_init_shadow(&kv, self->kv, heads);
    if (s != GY_OK) return gy_py_raise(s);
    GyKVObject *shadow = (GyKVObject *)((PyTypeObject *)gy_py_kv_type)->tp_alloc((PyTypeObject *)gy_py_kv_type, 0);
    if (shadow == NULL) {
        gy_kv_free(kv);
        return NULL;
    }
    shadow->arena_object = Py_NewRef(self->arena_object);
    shadow->kv = kv;
    return (PyObject *)shadow;
}

/* view(factor) -> a KVCache reading this cache's blocks as factor-times-longer blocks of
 * 1/factor of the heads, sharing its pool (gy_kv_init_view); it keeps this cache alive. */
static PyObject *gy_py_kv_view(GyKVObject *self, PyObject *args) {
    long long factor;
    if (!PyArg_ParseTuple(args, "L", &factor)) return NULL;
    gy_kv_cache *kv;
    gy_status s = gy_kv_init_view(&kv, self->kv, factor);
    if (s != GY_OK) return gy_py_raise(s);
    GyKVObject *view = (GyKVObject *)((PyTypeObject *)gy_py_kv_type)->tp_alloc((PyTypeObject *)gy_py_kv_type, 0);
    if (view == NULL) {
        gy_kv_free(kv);
        return NULL;
    }
    view->arena_object = Py_NewRef(self->arena_object);
    view->base_object = Py_NewRef((PyObject *)self);
    view->kv = kv;
    return (PyObject *)view;
}

static PyObject *gy_py_kv_take_pages(GyKVObject *self, PyObject *unused) {
    gy_kv_take_pages(self->kv);
    Py_RETURN_NONE;
}

static PyObject *gy_py_kv_set_page_cap(GyKVObject *self, PyObject *args) {
    long long pages;
    if (!PyArg_ParseTuple(args, "L", &pages)) return NULL;
    GY_PY_KV_CALL(gy_kv_set_page_cap(self->kv, pages));
    Py_RETURN_NONE;
}

static PyObject *gy_py_kv_page_cap(GyKVObject *self, PyObject *unused) {
    return PyLong_FromLongLong(gy_kv_page_cap(self->kv));
}

static PyObject *gy_py_kv_set_layers(GyKVObject *self, PyObject *args) {
    long long first, n;
    if (!PyArg_ParseTuple(args, "LL", &first, &n)) return NULL;
    GY_PY_KV_CALL(gy_kv_set_layers(self->kv, first, n));
    Py_RETURN_NONE;
}

static PyObject *gy_py_kv_compact(GyKVObject *self, PyObject *args) {
    long long keep;
    int64_t moved = 0;
    if (!PyArg_ParseTuple(args, "L", &keep)) return NULL;
    GY_PY_KV_CALL(gy_kv_compact(self->kv, keep, &moved));
    return PyLong_FromLongLong(moved);
}

static PyMethodDef gy_py_kv_methods[] = {
    {"shadow", (PyCFunction)gy_py_kv_shadow, METH_VARARGS, "shadow(n_heads) -> KVCache over the same pages"},
    {"take_pages", (PyCFunction)gy_py_kv_take_pages, METH_NOARGS, "take_pages(): a shadow becomes the owner"},
    {"view", (PyCFunction)gy_py_kv_view, METH_VARARGS, "view(factor) -> KVCache sharing this cache's block pool"},
    {"reshape", (PyCFunction)gy_py_kv_reshape, METH_VARARGS, "reshape(n_heads): header-centric blocks of n_heads heads"},
    {"seq_adopt", (PyCFunction)gy_py_kv_seq_adopt, METH_VARARGS, "seq_adopt(blocks, n_tokens) -> seq"},
    {"grow", (PyCFunction)gy_py_kv_grow, METH_VARARGS, "grow(pages)"},
    {"set_page_cap", (PyCFunction)gy_py_kv_set_page_cap, METH_VARARGS,
     "set_page_cap(pages): growth stops at `pages` per layer (< 0: the reserved slots)"},
    {"page_cap", (PyCFunction)gy_py_kv_page_cap, METH_NOARGS, "page_cap() -> pages per layer"},
    {"set_layers", (PyCFunction)gy_py_kv_set_layers, METH_VARARGS,
     "set_layers(first_layer, n_layers): hold these model layers (a pipeline re-split)"},
    {"compact", (PyCFunction)gy_py_kv_compact, METH_VARARGS,
     "compact(keep) -> blocks moved below `keep`"},
    {"shrink", (PyCFunction)gy_py_kv_shrink, METH_VARARGS, "shrink(pages)"},
    {"shrinkable", (PyCFunction)gy_py_kv_shrinkable, METH_NOARGS,
     "shrinkable() -> pages per layer past the last block in use"},
    {"seq_new", (PyCFunction)gy_py_kv_seq_new, METH_NOARGS, "seq_new() -> seq id"},
    {"seq_reserve", (PyCFunction)gy_py_kv_seq_reserve, METH_VARARGS, "seq_reserve(seq, n_tokens)"},
    {"seq_free", (PyCFunction)gy_py_kv_seq_free, METH_VARARGS, "seq_free(seq)"},
    {"seq_free_all", (PyCFunction)gy_py_kv_seq_free_all, METH_NOARGS, "seq_free_all(): every live one"},
    {"unshare", (PyCFunction)gy_py_kv_unshare, METH_NOARGS,
     "unshare(): a shadow lets its owner keep the pages and is left empty"},
    {"seq_blocks", (PyCFunction)gy_py_kv_seq_blocks, METH_VARARGS, "seq_blocks(seq) -> int32 bytes"},
    {"seq_n_tokens", (PyCFunction)gy_py_kv_seq_n_tokens, METH_VARARGS, "seq_n_tokens(seq) -> int"},
    {"write", (PyCFunction)gy_py_kv_write, METH_VARARGS, "write(seq, layer, pos, k, v)"},
    {"gather", (PyCFunction)gy_py_kv_gather, METH_VARARGS, "gather(seq, layer, pos, k_out, v_out)"},
    {"stats", (PyCFunction)gy_py_kv_stats, METH_NOARGS, "stats() -> dict"},
    {"layout", (PyCFunction)gy_py_kv_layout, METH_NOARGS, "layout() -> dict of strides"},
    {"layer_offset", (PyCFunction)gy_py_kv_layer_offset, METH_VARARGS, "layer_offset(layer) -> bytes"},
    {"layer_view", (PyCFunction)gy_py_kv_layer_view, METH_VARARGS, "layer_view(layer) -> ArenaView"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot gy_py_kv_slots[] = {
    {Py_tp_new, gy_py_kv_new},
    {Py_tp_dealloc, gy_py_kv_dealloc},
    {Py_tp_methods, gy_py_kv_methods},
    {Py_tp_doc, "KVCache(arena, layout, n_layers, n_heads, head_dim, block_size, elem_size, "
                "first_slot, slots_per_layer): a paged KV cache."},
    {0, NULL},
};

static PyType_Spec gy_py_kv_spec = {
    .name = "gyges._C.KVCache",
    .basicsize = sizeof(GyKVObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_kv_slots,
};

gy_kv_cache *gy_py_kv_unwrap(PyObject *object) {
    if (!PyObject_TypeCheck(object, (PyTypeObject *)gy_py_kv_type)) {
        PyErr_SetString(GY_PY_TYPE_ERROR, "expected a gyges._C.KVCache");
        return NULL;
    }
    return ((GyKVObject *)object)->kv;
}

int gy_py_kv_add(PyObject *module) {
    gy_py_kv_type = PyType_FromModuleAndSpec(module, &gy_py_kv_spec, NULL);
    if (gy_py_kv_type == NULL || PyModule_AddObjectRef(module, "KVCache", gy_py_kv_type) < 0)
        return -1;
    return 0;
}
