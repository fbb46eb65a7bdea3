/* py_model.c: gyges._C.Model, a decoder whose weights live in an Arena, with its own thread
 * pool (cpu) or CUDA stream (cuda: the arena's device), and its forward pass over a KVCache.
 * gyges/worker.py checks the arguments; this file checks what C needs to stay safe. */
#include "py_common.h"

#include "engine/forward.h"
#include "engine/forward_cuda.h"
#include "engine/model.h"
#include "kv/kv_cache.h"

typedef struct {
    PyObject_HEAD
    PyObject *arena_object; /* strong: the weights live there */
    gy_model model;
    gy_threadpool *pool;
    gy_forward_ws ws;
    uint32_t shards;        /* FFN shards whose pointers are set */
} GyModelObject;

static PyObject *gy_py_model_type;

/* The offsets buffer (int64, -1 = absent) in this order: embed, final_norm, lm_head, then per
 * layer attn_norm, ffn_norm, wq, wk, wv, wo_t, bq, bk, bv, q_norm, k_norm, router, shared_gate,
 * gate[max_tp], up[max_tp], down_t[max_tp] (the dense FFN, or an MoE layer's shared expert), and
 * for each of n_experts experts its gate[max_tp], up[max_tp], down_t[max_tp]. */
#define GY_PY_MODEL_LAYER_FIXED 13

static const void *gy_py_at(uintptr_t base, int64_t offset) {
    return offset < 0 ? NULL : (const void *)(base + (uintptr_t)offset);
}

/* Model(arena, spec, offsets, shards, threads=1, tables_from=None, layers=None, embed=True,
 *       head=True, *, rope_inv_freq, rope_mscale=1.0, n_experts=0, experts_used=0,
 *       expert_intermediate=0, shared_intermediate=0, norm_topk_prob=False, experts=None):
 * experts = (begin, end), the block of whole experts of an expert-parallel rank (None: all,
 * TP-sharded by `shards`); spec = (vocab,
 * hidden, intermediate, n_layers, n_heads, n_kv_heads, head_dim, max_tp, max_pos, weight dtype
 * id, rms_eps); rope_inv_freq: a buffer of head_dim / 2 float64 (gyges/models/rope.py). */
static PyObject *gy_py_model_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"arena", "spec", "offsets", "shards", "threads", "tables_from",
                            "layers", "embed", "head", "rope_inv_freq", "rope_mscale",
                            "n_experts", "experts_used", "expert_intermediate",
                            "shared_intermediate", "norm_topk_prob", "experts", NULL};
    PyObject *arena_object, *offsets_object, *tables_from = Py_None, *layers = Py_None;
    PyObject *inv_freq_object = NULL;
    int has_embed = 1, has_head = 1;
    long long vocab, hidden, inter, n_layers, n_heads, n_kv_heads, head_dim, max_tp, max_pos;
    int dtype, threads = 1;
    unsigned int shards;
    double eps, mscale = 1.0;
    long long n_experts = 0, experts_used = 0, expert_inter = 0, shared_inter = 0;
    int norm_topk = 0;
    PyObject *experts = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O(LLLLLLLLLid)OI|iOOpp$OdLLLLpO", names,
                                     &arena_object, &vocab, &hidden, &inter, &n_layers, &n_heads,
                                     &n_kv_heads, &head_dim, &max_tp, &max_pos, &dtype, &eps,
                                     &offsets_object, &shards, &threads, &tables_from, &layers,
                                     &has_embed, &has_head, &inv_freq_object, &mscale, &n_experts,
                                     &experts_used, &expert_inter, &shared_inter, &norm_topk,
                                     &experts))
        return NULL;
    long long expert_begin = 0, expert_end = n_experts;
    if (experts != Py_None && !PyArg_ParseTuple(experts, "LL", &expert_begin, &expert_end))
        return NULL;
    if (inv_freq_object == NULL)
        return PyErr_Format(GY_PY_TYPE_ERROR, "Model needs rope_inv_freq (head_dim / 2 float64)");
    long long layer_begin = 0, layer_end = n_layers;
    if (layers != Py_None && !PyArg_ParseTuple(layers, "LL", &layer_begin, &layer_end)) return NULL;
    if (tables_from != Py_None && !PyObject_TypeCheck(tables_from, (PyTypeObject *)gy_py_model_type))
        return PyErr_Format(GY_PY_TYPE_ERROR, "tables_from must be a Model or None, not %s",
                            Py_TYPE(tables_from)->tp_name);
    gy_arena *arena = gy_py_arena_unwrap(arena_object);
    if (arena == NULL) return NULL;
    /* The weights' addresses: host pointers on a cpu arena, device addresses on a cuda one. */
    const int on_cuda = gy_arena_backend(arena) == GY_ARENA_BACKEND_CUDA;
    uintptr_t base = on_cuda ? gy_arena_base_address(arena) : (uintptr_t)gy_arena_host_ptr(arena, 0);
    if (base == 0)
        return PyErr_Format(gy_py_error_class(GY_ERR_UNAVAILABLE),
                            "the arena's memory is neither host memory nor a CUDA device's");
    /* A bad head_dim is gy_model_init's to refuse, with no frequencies to read; good ones are
     * copied out of the buffer, which need not be aligned for doubles. */
    double *inv_freq = NULL;
    if (head_dim > 0 && head_dim % 2 == 0 && head_dim <= (1LL << 40)) {
        Py_buffer view;
        const Py_ssize_t bytes = (Py_ssize_t)(head_dim / 2 * 8);
        if (gy_py_get_buffer(inv_freq_object, &view, bytes, 0, "rope_inv_freq") < 0) return NULL;
        inv_freq = PyMem_Malloc((size_t)bytes);
        if (inv_freq != NULL) memcpy(inv_freq, view.buf, (size_t)bytes);
        PyBuffer_Release(&view);
        if (inv_freq == NULL) return PyErr_NoMemory();
    }
    GyModelObject *self = (GyModelObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        PyMem_Free(inv_freq);
        return NULL;
    }
    gy_model *m = &self->model;
    m->vocab = vocab; m->hidden = hidden; m->intermediate = inter; m->n_layers = n_layers;
    m->n_heads = n_heads; m->n_kv_heads = n_kv_heads; m->head_dim = head_dim; m->max_tp = max_tp;
    m->max_pos = max_pos; m->weight_dtype = (gy_dtype)dtype; m->rms_eps = (float)eps;
    m->n_experts = n_experts; m->n_experts_used = experts_used;
    m->expert_intermediate = expert_inter; m->shared_intermediate = shared_inter;
    m->norm_topk_prob = norm_topk;
    self->shards = shards;
    gy_status s = gy_model_init(m, inv_freq, mscale,
                                tables_from == Py_None ? NULL
                                                       : &((GyModelObject *)tables_from)->model);
    PyMem_Free(inv_freq);
    if (s != GY_OK) {
        Py_DECREF(self);
        return gy_py_raise(s);
    }
    /* gy_model_init bounded max_tp, n_experts and n_layers' allocation: no product wraps */
    const int64_t per_layer = GY_PY_MODEL_LAYER_FIXED + 3 * max_tp * (1 + n_experts);
    Py_buffer view;
    if (gy_py_get_buffer(offsets_object, &view, (Py_ssize_t)((3 + n_layers * per_layer) * 8), 0,
                         "weight offsets") < 0) {
        Py_DECREF(self);
        return NULL;
    }
    const int64_t *off = view.buf;
    const uint64_t limit = gy_arena_n_slots(arena) * gy_arena_page_size(arena);
    for (Py_ssize_t i = 0; i < view.len / 8; i++)
        if (off[i] >= 0 && (uint64_t)off[i] >= limit) {
            PyBuffer_Release(&view);
            Py_DECREF(self);
            return PyErr_Format(GY_PY_VALUE_ERROR, "weight offset %lld is outside the arena", (long long)off[i]);
        }
    m->embed = gy_py_at(base, off[0]);
    m->final_norm = gy_py_at(base, off[1]);
    m->lm_head = gy_py_at(base, off[2]);
    for (int64_t l = 0; l < n_layers; l++) {
        const int64_t *o = off + 3 + l * per_layer;
        gy_layer_weights *w = &m->layers[l];
        w->attn_norm = gy_py_at(base, o[0]);
        w->ffn_norm = gy_py_at(base, o[1]);
        w->wq = gy_py_at(base, o[2]);
        w->wk = gy_py_at(base, o[3]);
        w->wv = gy_py_at(base, o[4]);
        w->wo_t = gy_py_at(base, o[5]);
        w->bq = gy_py_at(base, o[6]);
        w->bk = gy_py_at(base, o[7]);
        w->bv = gy_py_at(base, o[8]);
        w->q_norm = gy_py_at(base, o[9]);
        w->k_norm = gy_py_at(base, o[10]);
        w->router = gy_py_at(base, o[11]);
        w->shared_gate = gy_py_at(base, o[12]);
        for (int64_t t = 0; t < max_tp; t++) {
            w->gate[t] = gy_py_at(base, o[GY_PY_MODEL_LAYER_FIXED + t]);
            w->up[t] = gy_py_at(base, o[GY_PY_MODEL_LAYER_FIXED + max_tp + t]);
            w->down_t[t] = gy_py_at(base, o[GY_PY_MODEL_LAYER_FIXED + 2 * max_tp + t]);
        }
        for (int64_t e = 0; e < n_experts; e++) {
            const int64_t *x = o + GY_PY_MODEL_LAYER_FIXED + 3 * max_tp * (1 + e);
            for (int64_t t = 0; t < max_tp; t++) {
                w->experts[e].gate[t] = gy_py_at(base, x[t]);
                w->experts[e].up[t] = gy_py_at(base, x[max_tp + t]);
                w->experts[e].down_t[t] = gy_py_at(base, x[2 * max_tp + t]);
            }
        }
    }
    PyBuffer_Release(&view);
    m->layer_begin = layer_begin;
    m->layer_end = layer_end;
    m->expert_begin = expert_begin;
    m->expert_end = expert_end;
    m->has_embed = has_embed;
    m->has_head = has_head;
    s = gy_model_check(m, shards);
    if (s == GY_OK && on_cuda) {
        Py_BEGIN_ALLOW_THREADS
        s = gy_forward_cuda_attach(m, gy_arena_device(arena));
        Py_END_ALLOW_THREADS
    } else if (s == GY_OK && threads > 1) {
        s = gy_threadpool_init(&self->pool, threads);
    }
    if (s != GY_OK) {
        Py_DECREF(self);
        return gy_py_raise(s);
    }
    self->arena_object = Py_NewRef(arena_object);
    return (PyObject *)self;
}

static void gy_py_model_dealloc(GyModelObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_threadpool_free(self->pool);
    gy_forward_ws_free(&self->ws); /* before the stream its cuBLAS handle is bound to */
    gy_forward_cuda_detach(&self->model);
    gy_model_free(&self->model);
    Py_XDECREF(self->arena_object);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* forward(kv, tokens, token_seq, token_pos, bt_indptr, bt_indices, logit_rows, logits_out):
 * int32 buffers; logits_out float32 [len(logit_rows), vocab]. TP1 on this worker. */
static PyObject *gy_py_model_forward(GyModelObject *self, PyObject *args) {
    PyObject *kv_object, *objects[7];
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &kv_object, &objects[0], &objects[1], &objects[2],
                          &objects[3], &objects[4], &objects[5], &objects[6]))
        return NULL;
    gy_kv_cache *kv = gy_py_kv_unwrap(kv_object);
    if (kv == NULL) return NULL;
    Py_buffer views[7];
    int n_views = 0;
    PyObject *result = NULL;
    for (; n_views < 7; n_views++) {
        const int writable = n_views == 6;
        if (PyObject_GetBuffer(objects[n_views], &views[n_views],
                               PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
            goto done;
    }
    const int64_t n_tokens = views[0].len / 4, n_seqs = views[3].len / 4 - 1;
    const int64_t n_logits = views[5].len / 4;
    if (views[1].len != views[0].len || views[2].len != views[0].len || n_seqs < 0 ||
        views[6].len != (Py_ssize_t)(n_logits * self->model.vocab * 4)) {
        PyErr_SetString(GY_PY_VALUE_ERROR, "forward: buffer sizes disagree");
        goto done;
    }
    gy_forward_batch batch = {
        .tokens = views[0].buf,
        .paged = {.n_tokens = n_tokens, .token_seq = views[1].buf, .token_pos = views[2].buf,
                  .n_seqs = n_seqs, .bt_indptr = views[3].buf, .bt_indices = views[4].buf},
        .n_logits = n_logits,
        .logit_rows = views[5].buf,
    };
    const int64_t n_indices = views[4].len / 4;
    const int32_t *indptr = views[3].buf;
    if (indptr[n_seqs] > n_indices) {
        PyErr_SetString(GY_PY_VALUE_ERROR, "forward: bt_indptr points past bt_indices");
        goto done;
    }
    gy_tp_group tp = {.rank = 0, .size = 1};
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_forward(views[6].buf, &self->model, &tp, kv, &batch, &self->ws, self->pool);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) {
        gy_py_raise(s);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < n_views; i++) PyBuffer_Release(&views[i]);
    return result;
}

gy_model *gy_py_model_unwrap(PyObject *object, gy_threadpool **pool) {
    if (!PyObject_TypeCheck(object, (PyTypeObject *)gy_py_model_type)) {
        PyErr_SetString(GY_PY_TYPE_ERROR, "expected a gyges._C.Model");
        return NULL;
    }
    *pool = ((GyModelObject *)object)->pool;
    return &((GyModelObject *)object)->model;
}

static PyObject *gy_py_model_get_backend(GyModelObject *self, void *closure) {
    return PyUnicode_FromString(self->model.backend == GY_MODEL_BACKEND_CUDA ? "cuda" : "cpu");
}

static PyObject *gy_py_model_get_device(GyModelObject *self, void *closure) {
    return PyLong_FromLong((long)self->model.device);
}

static PyGetSetDef gy_py_model_getset[] = {
    {"backend", (getter)gy_py_model_get_backend, NULL, "'cpu' or 'cuda'", NULL},
    {"device", (getter)gy_py_model_get_device, NULL, "CUDA device ordinal (cuda)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef gy_py_model_methods[] = {
    {"forward", (PyCFunction)gy_py_model_forward, METH_VARARGS,
     "forward(kv, tokens, token_seq, token_pos, bt_indptr, bt_indices, logit_rows, logits_out)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot gy_py_model_slots[] = {
    {Py_tp_new, gy_py_model_new},
    {Py_tp_dealloc, gy_py_model_dealloc},
    {Py_tp_methods, gy_py_model_methods},
    {Py_tp_getset, gy_py_model_getset},
    {Py_tp_doc, "Model(arena, spec, offsets, shards, threads=1, tables_from=None): a decoder in "
                "arena memory (on the arena's CUDA device when it is a cuda arena); the rotary "
                "tables are copied from the model tables_from when they match."},
    {0, NULL},
};

static PyType_Spec gy_py_model_spec = {
    .name = "gyges._C.Model",
    .basicsize = sizeof(GyModelObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_model_slots,
};

int gy_py_model_add(PyObject *module) {
    gy_py_model_type = PyType_FromModuleAndSpec(module, &gy_py_model_spec, NULL);
    if (gy_py_model_type == NULL || PyModule_AddObjectRef(module, "Model", gy_py_model_type) < 0)
        return -1;
    return 0;
}
