/* py_arena.c: gyges._C.Arena (a page arena) and gyges._C.ArenaView (a pinned buffer over its
 * memory that NumPy arrays are built on). Arguments are checked by gyges/arena.py; here only
 * what C needs to stay safe is checked, and the core checks the rest. */
#include <stddef.h>

#include "py_common.h"
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    gy_arena *arena;
} GyArenaObject;

typedef struct {
    PyObject_HEAD
    PyObject *arena_object; /* strong: the arena must outlive the memory */
    PyObject *keep;         /* strong, optional: e.g. the KV cache whose layer this is */
    gy_arena *arena;
    char *ptr;
    Py_ssize_t nbytes;
    int64_t first_slot;
    int64_t n_slots;
    int readonly;
} GyArenaViewObject;

static PyObject *gy_py_arena_type;
static PyObject *gy_py_arena_view_type;

gy_arena *gy_py_arena_unwrap(PyObject *object) {
    if (!PyObject_TypeCheck(object, (PyTypeObject *)gy_py_arena_type)) {
        PyErr_SetString(GY_PY_TYPE_ERROR, "expected a gyges._C.Arena");
        return NULL;
    }
    return ((GyArenaObject *)object)->arena;
}

/* ---- Arena ---- */

static PyObject *gy_py_arena_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"backend", "device", "page_size", "n_slots", "budget", "pool_pages", NULL};
    int backend = 0, device = 0;
    unsigned long long page_size = 0, n_slots = 0, budget = 0;
    unsigned int pool_pages = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iiKKK|I", names, &backend, &device, &page_size,
                                     &n_slots, &budget, &pool_pages))
        return NULL;
    gy_arena_config config = {
        .backend = (gy_arena_backend_kind)backend,
        .device = device,
        .page_size = page_size,
        .n_slots = n_slots,
        .budget_bytes = budget,
        .pool_pages = pool_pages,
    };
    gy_arena *arena = NULL;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_arena_init(&arena, &config);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    GyArenaObject *self = (GyArenaObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        gy_arena_free(arena);
        return NULL;
    }
    self->arena = arena;
    return (PyObject *)self;
}

static void gy_py_arena_dealloc(GyArenaObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_arena_free(self->arena);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyObject *gy_py_arena_create_page(GyArenaObject *self, PyObject *args) {
    int tag;
    if (!PyArg_ParseTuple(args, "i", &tag)) return NULL;
    int64_t page;
    gy_status s = gy_arena_create_page(self->arena, (gy_page_tag)tag, &page);
    if (s != GY_OK) return gy_py_raise(s);
    return PyLong_FromLongLong(page);
}

/* The single- and two-integer operations share one shape. */
#define GY_PY_ARENA_OP1(name, call)                                                                \
    static PyObject *gy_py_arena_##name(GyArenaObject *self, PyObject *args) {                     \
        long long a;                                                                               \
        if (!PyArg_ParseTuple(args, "L", &a)) return NULL;                                         \
        gy_status s = call;                                                                        \
        if (s != GY_OK) return gy_py_raise(s);                                                     \
        Py_RETURN_NONE;                                                                            \
    }
#define GY_PY_ARENA_OP2(name, call)                                                                \
    static PyObject *gy_py_arena_##name(GyArenaObject *self, PyObject *args) {                     \
        long long a, b;                                                                            \
        if (!PyArg_ParseTuple(args, "LL", &a, &b)) return NULL;                                    \
        gy_status s;                                                                               \
        Py_BEGIN_ALLOW_THREADS                                                                     \
        s = call;                                                                                  \
        Py_END_ALLOW_THREADS                                                                       \
        if (s != GY_OK) return gy_py_raise(s);                                                     \
        Py_RETURN_NONE;                                                                            \
    }

GY_PY_ARENA_OP1(release_page, gy_arena_release_page(self->arena, a))
GY_PY_ARENA_OP1(unmap, gy_arena_unmap(self->arena, a))
GY_PY_ARENA_OP2(map, gy_arena_map(self->arena, a, b))
GY_PY_ARENA_OP2(remap, gy_arena_remap(self->arena, a, b))
GY_PY_ARENA_OP2(shrink, gy_arena_shrink(self->arena, a, b))

static PyObject *gy_py_arena_grow(GyArenaObject *self, PyObject *args) {
    long long slot, n;
    int tag;
    if (!PyArg_ParseTuple(args, "LLi", &slot, &n, &tag)) return NULL;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_arena_grow(self->arena, slot, n, (gy_page_tag)tag);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_arena_copy(GyArenaObject *self, PyObject *args) {
    unsigned long long dst, src, nbytes;
    if (!PyArg_ParseTuple(args, "KKK", &dst, &src, &nbytes)) return NULL;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_arena_copy(self->arena, dst, src, nbytes);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

/* write(offset, buffer): the buffer's bytes into the arena (any backend). */
static PyObject *gy_py_arena_write(GyArenaObject *self, PyObject *args) {
    unsigned long long offset;
    PyObject *object;
    if (!PyArg_ParseTuple(args, "KO", &offset, &object)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(object, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_arena_write(self->arena, offset, view.buf, (uint64_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

/* read(offset, out): fills the writable buffer `out` from the arena (any backend). */
static PyObject *gy_py_arena_read(GyArenaObject *self, PyObject *args) {
    unsigned long long offset;
    PyObject *object;
    if (!PyArg_ParseTuple(args, "KO", &offset, &object)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(object, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_arena_read(self->arena, view.buf, offset, (uint64_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_arena_stats(GyArenaObject *self, PyObject *unused) {
    gy_arena_stats st;
    gy_arena_stats_get(self->arena, &st);
    return Py_BuildValue(
        "{sKsKsKsKsKsKs{sKsKsKsK}sKsKsKsKsKsKsK}", "page_size", st.page_size, "n_slots", st.n_slots,
        "max_pages", st.max_pages, "budget_bytes", st.budget_bytes, "bytes_in_use",
        st.bytes_in_use, "peak_bytes", st.peak_bytes, "bytes_by_tag", "weights",
        st.bytes_by_tag[GY_PAGE_TAG_WEIGHTS], "kv", st.bytes_by_tag[GY_PAGE_TAG_KV], "staging",
        st.bytes_by_tag[GY_PAGE_TAG_STAGING], "other", st.bytes_by_tag[GY_PAGE_TAG_OTHER],
        "pages_mapped", st.pages_mapped, "pages_created_total", st.pages_created_total,
        "pages_released_total", st.pages_released_total, "maps_total", st.maps_total,
        "unmaps_total", st.unmaps_total, "remaps_total", st.remaps_total, "bytes_copied_total",
        st.bytes_copied_total);
}

/* driver_times() -> {call: (calls, seconds)} for create, map, set_access, unmap, release. */
static PyObject *gy_py_arena_driver_times(GyArenaObject *self, PyObject *unused) {
    static const char *const names[GY_ARENA_DRIVER_CALL_COUNT] = {"create", "map", "set_access",
                                                                  "unmap", "release"};
    gy_arena_driver_times t;
    gy_arena_driver_times_get(self->arena, &t);
    PyObject *out = PyDict_New();
    for (int k = 0; out != NULL && k < GY_ARENA_DRIVER_CALL_COUNT; k++) {
        PyObject *row = Py_BuildValue("(Ld)", (long long)t.calls[k], t.seconds[k]);
        if (row == NULL || PyDict_SetItemString(out, names[k], row) < 0) Py_CLEAR(out);
        Py_XDECREF(row);
    }
    return out;
}

static PyObject *gy_py_arena_reset_peak(GyArenaObject *self, PyObject *unused) {
    gy_arena_reset_peak(self->arena);
    Py_RETURN_NONE;
}

/* page_table(out): fills a writable buffer of n_slots gy_page_entry rows. */
static PyObject *gy_py_arena_page_table(GyArenaObject *self, PyObject *out) {
    const uint64_t n = gy_arena_n_slots(self->arena);
    Py_buffer view;
    if (gy_py_get_buffer(out, &view, (Py_ssize_t)(n * sizeof(gy_page_entry)), 1, "page table") < 0)
        return NULL;
    int64_t written = gy_arena_page_table(self->arena, view.buf, (int64_t)n);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong(written);
}

/* physical_table(out): fills a writable buffer of max_pages gy_phys_entry rows; returns the
 * number of created pages written. */
static PyObject *gy_py_arena_physical_table(GyArenaObject *self, PyObject *out) {
    gy_arena_stats st;
    gy_arena_stats_get(self->arena, &st);
    Py_buffer view;
    if (gy_py_get_buffer(out, &view, (Py_ssize_t)(st.max_pages * sizeof(gy_phys_entry)), 1,
                         "physical table") < 0)
        return NULL;
    int64_t written = gy_arena_physical_table(self->arena, view.buf, (int64_t)st.max_pages);
    PyBuffer_Release(&view);
    return PyLong_FromLongLong(written);
}

static PyObject *gy_py_arena_view(GyArenaObject *self, PyObject *args) {
    unsigned long long offset, nbytes;
    int readonly = 0;
    if (!PyArg_ParseTuple(args, "KK|p", &offset, &nbytes, &readonly)) return NULL;
    return gy_py_arena_view_new((PyObject *)self, NULL, offset, nbytes, readonly);
}

static PyObject *gy_py_arena_get_page_size(GyArenaObject *self, void *closure) {
    return PyLong_FromUnsignedLongLong(gy_arena_page_size(self->arena));
}
static PyObject *gy_py_arena_get_n_slots(GyArenaObject *self, void *closure) {
    return PyLong_FromUnsignedLongLong(gy_arena_n_slots(self->arena));
}
static PyObject *gy_py_arena_get_backend(GyArenaObject *self, void *closure) {
    return PyLong_FromLong((long)gy_arena_backend(self->arena));
}
static PyObject *gy_py_arena_get_device(GyArenaObject *self, void *closure) {
    return PyLong_FromLong((long)gy_arena_device(self->arena));
}
static PyObject *gy_py_arena_get_host_accessible(GyArenaObject *self, void *closure) {
    return PyBool_FromLong(gy_arena_host_ptr(self->arena, 0) != NULL);
}
static PyObject *gy_py_arena_get_base_address(GyArenaObject *self, void *closure) {
    return PyLong_FromUnsignedLongLong((unsigned long long)gy_arena_base_address(self->arena));
}

/* copy_runs(src_arena, dst_offsets, src_offsets, nbytes): uint64 buffers of one length. */
static PyObject *gy_py_arena_copy_runs(GyArenaObject *self, PyObject *args) {
    PyObject *src_object, *objects[3];
    if (!PyArg_ParseTuple(args, "OOOO", &src_object, &objects[0], &objects[1], &objects[2])) return NULL;
    gy_arena *src = gy_py_arena_unwrap(src_object);
    if (src == NULL) return NULL;
    Py_buffer views[3];
    int n_views = 0;
    for (; n_views < 3; n_views++)
        if (PyObject_GetBuffer(objects[n_views], &views[n_views], PyBUF_C_CONTIGUOUS) < 0) break;
    PyObject *result = NULL;
    if (n_views == 3) {
        if (views[1].len != views[0].len || views[2].len != views[0].len || views[0].len % 8 != 0) {
            PyErr_SetString(GY_PY_VALUE_ERROR, "copy_runs: offset and size buffers must be uint64 of one length");
        } else {
            gy_status s;
            Py_BEGIN_ALLOW_THREADS
            s = gy_arena_copy_runs(self->arena, src, views[0].buf, views[1].buf, views[2].buf,
                                   views[0].len / 8);
            Py_END_ALLOW_THREADS
            result = s == GY_OK ? Py_NewRef(Py_None) : gy_py_raise(s);
        }
    }
    for (int i = 0; i < n_views; i++) PyBuffer_Release(&views[i]);
    return result;
}

static PyMethodDef gy_py_arena_methods[] = {
    {"copy_runs", (PyCFunction)gy_py_arena_copy_runs, METH_VARARGS,
     "copy_runs(src_arena, dst_offsets, src_offsets, nbytes): runs from another arena into this one"},
    {"create_page", (PyCFunction)gy_py_arena_create_page, METH_VARARGS, "create_page(tag) -> page id"},
    {"release_page", (PyCFunction)gy_py_arena_release_page, METH_VARARGS, "release_page(page)"},
    {"map", (PyCFunction)gy_py_arena_map, METH_VARARGS, "map(slot, page)"},
    {"unmap", (PyCFunction)gy_py_arena_unmap, METH_VARARGS, "unmap(slot)"},
    {"remap", (PyCFunction)gy_py_arena_remap, METH_VARARGS, "remap(from_slot, to_slot)"},
    {"grow", (PyCFunction)gy_py_arena_grow, METH_VARARGS, "grow(slot, n, tag)"},
    {"shrink", (PyCFunction)gy_py_arena_shrink, METH_VARARGS, "shrink(slot, n)"},
    {"copy", (PyCFunction)gy_py_arena_copy, METH_VARARGS, "copy(dst_offset, src_offset, nbytes)"},
    {"write", (PyCFunction)gy_py_arena_write, METH_VARARGS, "write(offset, buffer): host bytes into the arena"},
    {"read", (PyCFunction)gy_py_arena_read, METH_VARARGS, "read(offset, out): arena bytes into a host buffer"},
    {"stats", (PyCFunction)gy_py_arena_stats, METH_NOARGS, "stats() -> dict"},
    {"driver_times", (PyCFunction)gy_py_arena_driver_times, METH_NOARGS,
     "driver_times() -> {call: (calls, seconds)}"},
    {"reset_peak", (PyCFunction)gy_py_arena_reset_peak, METH_NOARGS, "reset_peak()"},
    {"page_table", (PyCFunction)gy_py_arena_page_table, METH_O, "page_table(out) -> rows"},
    {"physical_table", (PyCFunction)gy_py_arena_physical_table, METH_O, "physical_table(out) -> rows"},
    {"view", (PyCFunction)gy_py_arena_view, METH_VARARGS, "view(offset, nbytes, readonly=False) -> ArenaView"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef gy_py_arena_getset[] = {
    {"page_size", (getter)gy_py_arena_get_page_size, NULL, "bytes per page", NULL},
    {"n_slots", (getter)gy_py_arena_get_n_slots, NULL, "virtual slots", NULL},
    {"backend", (getter)gy_py_arena_get_backend, NULL, "0 = cpu, 1 = cuda", NULL},
    {"base_address", (getter)gy_py_arena_get_base_address, NULL, "start of the virtual range", NULL},
    {"device", (getter)gy_py_arena_get_device, NULL, "CUDA device ordinal (0 on cpu)", NULL},
    {"host_accessible", (getter)gy_py_arena_get_host_accessible, NULL,
     "True when the memory is host memory (NumPy views work)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot gy_py_arena_slots[] = {
    {Py_tp_new, gy_py_arena_new},
    {Py_tp_dealloc, gy_py_arena_dealloc},
    {Py_tp_methods, gy_py_arena_methods},
    {Py_tp_getset, gy_py_arena_getset},
    {Py_tp_doc, "Arena(backend, device, page_size, n_slots, budget, pool_pages=0): a page arena."},
    {0, NULL},
};

static PyType_Spec gy_py_arena_spec = {
    .name = "gyges._C.Arena",
    .basicsize = sizeof(GyArenaObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_arena_slots,
};

/* ---- ArenaView ---- */

PyObject *gy_py_arena_view_new(PyObject *arena_object, PyObject *keep, uint64_t offset,
                               uint64_t nbytes, int readonly) {
    gy_arena *arena = gy_py_arena_unwrap(arena_object);
    if (arena == NULL) return NULL;
    const uint64_t page_size = gy_arena_page_size(arena);
    const uint64_t total = gy_arena_n_slots(arena) * page_size;
    if (nbytes == 0 || offset >= total || nbytes > total - offset) {
        PyErr_Format(GY_PY_VALUE_ERROR,
                     "a view of %llu bytes at offset %llu does not fit the arena's %llu bytes",
                     (unsigned long long)nbytes, (unsigned long long)offset, (unsigned long long)total);
        return NULL;
    }
    if (nbytes > (uint64_t)PY_SSIZE_T_MAX) {
        PyErr_SetString(GY_PY_VALUE_ERROR, "view too large");
        return NULL;
    }
    char *ptr = gy_arena_host_ptr(arena, offset);
    if (ptr == NULL) {
        PyErr_SetString(GY_PY_VALUE_ERROR,
                        "this arena's memory is device memory; NumPy views need the cpu backend");
        return NULL;
    }
    const int64_t first = (int64_t)(offset / page_size);
    const int64_t last = (int64_t)((offset + nbytes - 1) / page_size);
    gy_status s = gy_arena_pin(arena, first, last - first + 1);
    if (s != GY_OK) return gy_py_raise(s);
    GyArenaViewObject *view = PyObject_New(GyArenaViewObject, (PyTypeObject *)gy_py_arena_view_type);
    if (view == NULL) {
        gy_arena_unpin(arena, first, last - first + 1);
        return NULL;
    }
    view->arena_object = Py_NewRef(arena_object);
    view->keep = Py_XNewRef(keep);
    view->arena = arena;
    view->ptr = ptr;
    view->nbytes = (Py_ssize_t)nbytes;
    view->first_slot = first;
    view->n_slots = last - first + 1;
    view->readonly = readonly;
    return (PyObject *)view;
}

static void gy_py_arena_view_dealloc(GyArenaViewObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_arena_unpin(self->arena, self->first_slot, self->n_slots);
    Py_XDECREF(self->keep);
    Py_DECREF(self->arena_object);
    PyObject_Free(self);
    Py_DECREF(type);
}

static int gy_py_arena_view_getbuffer(GyArenaViewObject *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, self->nbytes, self->readonly, flags);
}

static PyObject *gy_py_arena_view_repr(GyArenaViewObject *self) {
    return PyUnicode_FromFormat("<gyges ArenaView slots [%lld, %lld), %zd bytes>",
                                (long long)self->first_slot,
                                (long long)(self->first_slot + self->n_slots), self->nbytes);
}

static PyMemberDef gy_py_arena_view_members[] = {
    {"first_slot", T_LONGLONG, offsetof(GyArenaViewObject, first_slot), READONLY, "first pinned slot"},
    {"n_slots", T_LONGLONG, offsetof(GyArenaViewObject, n_slots), READONLY, "pinned slots"},
    {"nbytes", T_PYSSIZET, offsetof(GyArenaViewObject, nbytes), READONLY, "bytes"},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot gy_py_arena_view_slots[] = {
    {Py_tp_dealloc, gy_py_arena_view_dealloc},
    {Py_bf_getbuffer, gy_py_arena_view_getbuffer},
    {Py_tp_repr, gy_py_arena_view_repr},
    {Py_tp_members, gy_py_arena_view_members},
    {Py_tp_doc, "Pinned buffer over arena memory; its slots cannot be unmapped while it lives."},
    {0, NULL},
};

static PyType_Spec gy_py_arena_view_spec = {
    .name = "gyges._C.ArenaView",
    .basicsize = sizeof(GyArenaViewObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_arena_view_slots,
};

int gy_py_arena_add(PyObject *module) {
    gy_py_arena_type = PyType_FromModuleAndSpec(module, &gy_py_arena_spec, NULL);
    if (gy_py_arena_type == NULL || PyModule_AddObjectRef(module, "Arena", gy_py_arena_type) < 0)
        return -1;
    gy_py_arena_view_type = PyType_FromModuleAndSpec(module, &gy_py_arena_view_spec, NULL);
    if (gy_py_arena_view_type == NULL ||
        PyModule_AddObjectRef(module, "ArenaView", gy_py_arena_view_type) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "PAGE_ENTRY_SIZE", sizeof(gy_page_entry)) < 0 ||
        PyModule_AddIntConstant(module, "PHYS_ENTRY_SIZE", sizeof(gy_phys_entry)) < 0)
        return -1;
    return 0;
}
