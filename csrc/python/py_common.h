/* py_common.h: what every file of both extensions shares: turning a gy_status into an exception,
 * and borrowing NumPy buffers (the Python wrappers have already checked dtype and shape). All of
 * it is defined in gyges._C; gyges._C_test (csrc/python_test/) links it from there. */
#ifndef GY_PY_COMMON_H
#define GY_PY_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "core/status.h"

/* ---- py_errors.c: the exception classes ---- */

/* Creates gyges._C.Error and its subclasses, one per gy_status, in `module`; 0, or -1 with an
 * exception. */
int gy_py_errors_add(PyObject *module);
/* Raises the gyges exception for `status` with the core's last message; returns NULL. */
PyObject *gy_py_raise(gy_status status);
/* The exception class for `status` (borrowed). */
PyObject *gy_py_error_class(gy_status status);
/* Arguments the C core never sees are checked here, and their errors are gyges errors too:
 * a bad value is an InvalidArgumentError (a ValueError), a wrong type an ArgumentTypeError
 * (an InvalidArgumentError and a TypeError). Both borrowed. */
#define GY_PY_VALUE_ERROR gy_py_error_class(GY_ERR_INVALID)
PyObject *gy_py_type_error(void);
#define GY_PY_TYPE_ERROR gy_py_type_error()

/* ---- py_common.c: reading arguments ---- */

/* PySequence_Fast whose refusal is an ArgumentTypeError with `message`. */
PyObject *gy_py_sequence(PyObject *object, const char *message);
/* A sequence of at most `cap` ints into `out` (`what` names it in errors): their count, or -1
 * with an exception. */
Py_ssize_t gy_py_int64s(PyObject *seq_object, int64_t *out, Py_ssize_t cap, const char *what);
/* The same for floats. */
Py_ssize_t gy_py_doubles(PyObject *seq_object, double *out, Py_ssize_t cap, const char *what);
/* Borrows a C-contiguous buffer of exactly `bytes` bytes (writable when `writable`); on failure
 * raises ValueError naming `what` and returns -1. Release with PyBuffer_Release. */
int gy_py_get_buffer(PyObject *object, Py_buffer *view, Py_ssize_t bytes, int writable,
                     const char *what);

/* Each file adds its functions and types to the module; 0 on success, -1 with an exception. */
int gy_py_backends_add(PyObject *module);
int gy_py_arena_add(PyObject *module);
int gy_py_kv_add(PyObject *module);
int gy_py_kv_patch_add(PyObject *module);
int gy_py_kv_move_add(PyObject *module);
int gy_py_model_add(PyObject *module);
int gy_py_engine_add(PyObject *module);
int gy_py_sim_add(PyObject *module);
int gy_py_comm_add(PyObject *module);
int gy_py_policy_add(PyObject *module);
int gy_py_cluster_add(PyObject *module);

/* From py_arena.c, for the other types that hand out views of arena memory. */
#include "mem/arena.h"
/* The gy_arena inside a gyges._C.Arena, or NULL with TypeError set. */
gy_arena *gy_py_arena_unwrap(PyObject *object);
/* A buffer exporter over [offset, offset+nbytes) of the arena's host memory that pins the slots
 * it covers for as long as it lives and keeps `arena_object` and `keep` (may be NULL) alive. */
PyObject *gy_py_arena_view_new(PyObject *arena_object, PyObject *keep, uint64_t offset,
                               uint64_t nbytes, int readonly);

/* From py_sim.c: a pipeline's parameters (gyges.costmodel.PipelineCost.params()) into *p,
 * checked; 0, or -1 with an exception. */
struct gy_sim_pipeline;
int gy_py_sim_pipeline_params(PyObject *params, struct gy_sim_pipeline *p);
/* A cost model's parameters (`kind` names it: roofline, profiled, constant) from a dict, checked,
 * into its member of *store, and the cost ops over it; 0, or -1 with an exception. */
struct gy_sim_cost_store;
struct gy_sim_cost_ops;
int gy_py_sim_cost_params(PyObject *params, const char *kind, struct gy_sim_cost_store *store,
                          struct gy_sim_cost_ops *ops);
/* A pipeline's split (layers per stage) from a sequence of n ints; 0, or -1 with an exception
 * naming `what`. */
int gy_py_sim_split(PyObject *o, int32_t n, int32_t *layers, const char *what);

/* From py_kv.c: the gy_kv_cache inside a gyges._C.KVCache, or NULL with TypeError set. */
struct gy_kv_cache;
struct gy_kv_cache *gy_py_kv_unwrap(PyObject *object);

/* From py_kv_patch.c: the gy_kv_dirty inside a gyges._C.KVDirty, or NULL with TypeError set. */
struct gy_kv_dirty;
struct gy_kv_dirty *gy_py_dirty_unwrap(PyObject *object);

/* From py_model.c: the gy_model inside a gyges._C.Model and its thread pool (may be NULL). */
struct gy_model;
struct gy_threadpool;
struct gy_model *gy_py_model_unwrap(PyObject *object, struct gy_threadpool **pool);

/* From py_comm.c: the gy_comm inside a gyges._C.Comm, or NULL with TypeError set. */
struct gy_comm;
struct gy_comm *gy_py_comm_unwrap(PyObject *object);

#endif
