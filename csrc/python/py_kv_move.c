/* py_kv_move.c: gyges._C.kv_move and gyges._C.KVMoveStage, over kv/kv_move.h: the one way KV
 * moves between caches (gyges/runtime/kv_cache.py's KVMove checks the arguments and builds the
 * items). Registers the device backend of KV moves at import.
 *
 * A move is (items, first_layer, end_layer, dirty=None, dirty_slots=0, overlap=False,
 * threads=1, comm=None), the same for kv_move and KVMoveStage.plan (comm: a gyges._C.Comm whose
 * ranks' devices hold the caches, for moves between CUDA devices); an item is a tuple
 *   (src KVCache, dst KVCache, src_blocks, dst_blocks, src_seq, dst_seq, src_head, dst_head,
 *    n_heads, n_tokens)
 * with the block lists int32 buffers of one length, or both None (the sequences' tables). */
#include "py_common.h"

#include "comm/kv_move_comm.h"
#include "kernels/kv_move_device.h"
#include "kv/kv_move.h"

/* A parsed move: the C description and what it borrows. */
typedef struct gy_py_move {
    gy_kv_move move;
    gy_kv_move_item *items;
    Py_buffer *lists;      /* (2 n_items); .obj NULL where none was taken */
    Py_buffer dirty;
    PyObject *held;        /* the items as a tuple: keeps every cache and list alive */
    PyObject *comm;        /* the communicator, alive until the move ends (or NULL) */
} gy_py_move;

static void gy_py_move_release(gy_py_move *m) {
    for (int64_t i = 0; m->lists != NULL && i < 2 * m->move.n_items; i++)
        if (m->lists[i].obj != NULL) PyBuffer_Release(&m->lists[i]);
    if (m->dirty.obj != NULL) PyBuffer_Release(&m->dirty);
    PyMem_Free(m->lists);
    PyMem_Free(m->items);
    Py_CLEAR(m->held);
    Py_CLEAR(m->comm);
}

/* The block list `object` (None or int32 buffer) into *view; its length in *n. */
static int gy_py_move_list(PyObject *object, Py_buffer *view, Py_ssize_t *n) {
    if (object == Py_None) {
        *n = -1;
        return 0;
    }
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % 4 != 0) {
        PyErr_SetString(GY_PY_VALUE_ERROR, "a KV move's block lists are int32 buffers");
        return -1;
    }
    *n = view->len / 4;
    return 0;
}

static int gy_py_move_parse(gy_py_move *m, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"items", "first_layer", "end_layer", "dirty", "dirty_slots", "overlap",
                            "threads", "comm", NULL};
    PyObject *items_object, *dirty_object = Py_None, *comm_object = Py_None;
    long long first, end, dirty_slots = 0;
    int overlap = 0, threads = 1;
    memset(m, 0, sizeof *m);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OLL|OLpiO", names, &items_object, &first,
                                     &end, &dirty_object, &dirty_slots, &overlap, &threads,
                                     &comm_object))
        return -1;
    m->held = PySequence_Tuple(items_object);
    if (m->held == NULL) return -1;
    const Py_ssize_t n = PyTuple_GET_SIZE(m->held);
    m->items = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *m->items);
    m->lists = PyMem_Calloc((size_t)(n > 0 ? 2 * n : 1), sizeof *m->lists);
    if (m->items == NULL || m->lists == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->move = (gy_kv_move){.items = m->items, .n_items = n, .first_layer = first,
                           .end_layer = end, .dirty_slots = dirty_slots,
                           .flags = overlap ? GY_KV_MOVE_OVERLAP : 0, .threads = threads};
    if (comm_object != Py_None) {
        if ((m->move.comm = gy_py_comm_unwrap(comm_object)) == NULL) return -1;
        m->comm = Py_NewRef(comm_object);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(m->held, i), *src, *dst, *lists[2];
        long long src_seq, dst_seq, src_head, dst_head, n_heads, n_tokens;
        if (!PyTuple_Check(item)) {
            PyErr_SetString(GY_PY_TYPE_ERROR, "a KV move item is a tuple");
            return -1;
        }
        if (!PyArg_ParseTuple(item, "OOOOLLLLLL", &src, &dst, &lists[0], &lists[1], &src_seq,
                              &dst_seq, &src_head, &dst_head, &n_heads, &n_tokens))
            return -1;
        gy_kv_move_item *it = &m->items[i];
        *it = (gy_kv_move_item){.src = gy_py_kv_unwrap(src), .src_seq = src_seq,
                                .dst_seq = dst_seq, .src_head = src_head, .dst_head = dst_head,
                                .n_heads = n_heads, .n_tokens = n_tokens};
        if (it->src == NULL || (it->dst = gy_py_kv_unwrap(dst)) == NULL) return -1;
        Py_ssize_t ns, nd;
        if (gy_py_move_list(lists[0], &m->lists[2 * i], &ns) < 0 ||
            gy_py_move_list(lists[1], &m->lists[2 * i + 1], &nd) < 0)
            return -1;
        if (ns != nd) {
            PyErr_Format(GY_PY_VALUE_ERROR, "move item %zd: %zd source blocks for %zd destination "
                         "blocks", i, ns, nd);
            return -1;
        }
        if (ns >= 0) {
            it->src_blocks = m->lists[2 * i].buf;
            it->dst_blocks = m->lists[2 * i + 1].buf;
            it->n_blocks = ns;
        }
    }
    if (dirty_object != Py_None) {
        if (dirty_slots < 0) {
            PyErr_SetString(GY_PY_VALUE_ERROR, "dirty_slots must be >= 0");
            return -1;
        }
        if (gy_py_get_buffer(dirty_object, &m->dirty, (Py_ssize_t)((dirty_slots + 63) / 64) * 8, 0,
                             "dirty") < 0)
            return -1;
        m->move.dirty = m->dirty.buf;
    }
    return 0;
}

static PyObject *gy_py_move_stats(const gy_kv_move_stats *st) {
    return Py_BuildValue("{s:L,s:K,s:K,s:K,s:K,s:L,s:L,s:K,s:L,s:L,s:s,s:K,s:K}", "slots",
                         (long long)st->slots, "bytes", (unsigned long long)st->bytes,
                         "bytes_in_place", (unsigned long long)st->bytes_in_place, "bytes_early",
                         (unsigned long long)st->bytes_early, "bytes_late",
                         (unsigned long long)st->bytes_late, "items_reused",
                         (long long)st->items_reused, "items_stale", (long long)st->items_stale,
                         "stage_bytes", (unsigned long long)st->stage_bytes, "runs_direct",
                         (long long)st->runs_direct, "runs_parked", (long long)st->runs_parked,
                         "backend", gy_kv_move_backend_name((gy_kv_move_backend_kind)st->backend),
                         "comm_bytes", (unsigned long long)st->comm_bytes, "staging_bytes",
                         (unsigned long long)st->staging_bytes);
}

/* ---- KVMoveStage ---- */

typedef struct {
    PyObject_HEAD
    gy_kv_move_stage *stage;
    PyObject *planned;       /* the planned items: keep their caches alive until the run */
    PyThread_type_lock lock; /* read() runs on another thread; one call at a time */
} GyKVStageObject;

static PyObject *gy_py_stage_type;

static PyObject *gy_py_stage_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "", names)) return NULL;
    GyKVStageObject *self = (GyKVStageObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->lock = PyThread_allocate_lock();
    const gy_status s = gy_kv_move_stage_init(&self->stage);
    if (self->lock == NULL || s != GY_OK) {
        PyObject *error = self->lock == NULL ? PyErr_NoMemory() : gy_py_raise(s);
        Py_DECREF(self);
        return error;
    }
    return (PyObject *)self;
}

static void gy_py_stage_dealloc(GyKVStageObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_kv_move_stage_free(self->stage);
    if (self->lock) PyThread_free_lock(self->lock);
    Py_XDECREF(self->planned);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* Takes the stage's lock without holding the GIL (a read() on another thread may hold it). */
static void gy_py_stage_lock(GyKVStageObject *self) {
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    Py_END_ALLOW_THREADS
}

static PyObject *gy_py_stage_plan(GyKVStageObject *self, PyObject *args, PyObject *kwargs) {
    gy_py_move m;
    if (gy_py_move_parse(&m, args, kwargs) < 0) {
        gy_py_move_release(&m);
        return NULL;
    }
    gy_py_stage_lock(self);
    const gy_status s = gy_kv_move_plan(self->stage, &m.move);
    Py_XSETREF(self->planned, s == GY_OK ? Py_NewRef(m.held) : NULL);
    PyThread_release_lock(self->lock);
    gy_py_move_release(&m);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_stage_read(GyKVStageObject *self, PyObject *unused) {
    (void)unused;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    s = gy_kv_move_read(self->stage);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyMethodDef gy_py_stage_methods[] = {
    {"plan", (PyCFunction)(void (*)(void))gy_py_stage_plan, METH_VARARGS | METH_KEYWORDS,
     "plan(items, first_layer, end_layer, ...): an early read's first half, between steps"},
    {"read", (PyCFunction)gy_py_stage_read, METH_NOARGS,
     "read(): copy the planned tokens into the stage (any thread, beside a step)"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot gy_py_stage_slots[] = {
    {Py_tp_new, gy_py_stage_new},
    {Py_tp_dealloc, gy_py_stage_dealloc},
    {Py_tp_methods, gy_py_stage_methods},
    {Py_tp_doc, "KVMoveStage(): the memory an overlapping KV move reads into, and its early read"},
    {0, NULL},
};

static PyType_Spec gy_py_stage_spec = {
    .name = "gyges._C.KVMoveStage",
    .basicsize = sizeof(GyKVStageObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_stage_slots,
};

/* ---- kv_move ---- */

/* kv_move(items, first_layer, end_layer, dirty=None, dirty_slots=0, overlap=False, threads=1,
 *         stage=None) -> stats */
static PyObject *gy_py_kv_move(PyObject *module, PyObject *args, PyObject *kwargs) {
    (void)module;
    PyObject *stage_object = Py_None;
    /* `stage` is this call's own: the rest is the move */
    if (kwargs != NULL && (stage_object = PyDict_GetItemString(kwargs, "stage")) != NULL) {
        kwargs = PyDict_Copy(kwargs);
        if (kwargs == NULL || PyDict_DelItemString(kwargs, "stage") < 0) {
            Py_XDECREF(kwargs);
            return NULL;
        }
    } else {
        stage_object = Py_None;
        Py_XINCREF(kwargs);
    }
    GyKVStageObject *stage = NULL;
    if (stage_object != Py_None) {
        if (!PyObject_TypeCheck(stage_object, (PyTypeObject *)gy_py_stage_type)) {
            Py_XDECREF(kwargs);
            PyErr_SetString(GY_PY_TYPE_ERROR, "stage must be a gyges._C.KVMoveStage");
            return NULL;
        }
        stage = (GyKVStageObject *)stage_object;
    }
    gy_py_move m;
    const int parsed = gy_py_move_parse(&m, args, kwargs);
    Py_XDECREF(kwargs);
    if (parsed < 0) {
        gy_py_move_release(&m);
        return NULL;
    }
    gy_kv_move_stats st;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    if (stage) PyThread_acquire_lock(stage->lock, WAIT_LOCK);
    s = gy_kv_move_run(&m.move, stage ? stage->stage : NULL, &st);
    if (stage) PyThread_release_lock(stage->lock);
    Py_END_ALLOW_THREADS
    if (stage) Py_CLEAR(stage->planned); /* a run forgets the plan */
    gy_py_move_release(&m);
    if (s != GY_OK) return gy_py_raise(s);
    return gy_py_move_stats(&st);
}

static PyMethodDef gy_py_kv_move_functions[] = {
    {"kv_move", (PyCFunction)(void (*)(void))gy_py_kv_move, METH_VARARGS | METH_KEYWORDS,
     "kv_move(items, first_layer, end_layer, dirty=None, dirty_slots=0, overlap=False, threads=1, "
     "comm=None, stage=None) -> stats"},
    {NULL, NULL, 0, NULL},
};

int gy_py_kv_move_add(PyObject *module) {
    gy_status s = gy_kv_move_device_register();
    if (s == GY_OK) s = gy_kv_move_comm_register();
    if (s != GY_OK) {
        gy_py_raise(s);
        return -1;
    }
    if (PyModule_AddFunctions(module, gy_py_kv_move_functions) < 0) return -1;
    gy_py_stage_type = PyType_FromModuleAndSpec(module, &gy_py_stage_spec, NULL);
    if (gy_py_stage_type == NULL || PyModule_AddObjectRef(module, "KVMoveStage", gy_py_stage_type) < 0)
        return -1;
    return 0;
}
