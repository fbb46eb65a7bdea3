/* py_engine.c: gyges._C.Engine, the single-worker serving loop over a Model and a KVCache.
 * gyges/engine.py owns the request handles and checks the arguments. */
#include "py_common.h"

#include "engine/engine.h"
#include "engine/handover.h"
#include "engine/peer.h"
#include "engine/remote.h"
#include "engine/resplit.h"
#include "engine/transition.h"

typedef struct {
    PyObject_HEAD
    PyObject *keep;    /* strong: a tuple of the models, KV caches and communicator used */
    PyObject *transition_keep; /* strong, while a transformation runs: its old models and caches */
    PyObject *dirty_keep;      /* strong: {(stage, rank): KVDirty} the steps mark */
    PyObject *outlet;          /* strong: the leader's outlet (peer.h), or NULL */
    gy_engine *engine;
} GyEngineObject;

/* The ranks of one stage: models and kvs are sequences of one entry per TP rank. 0, or -1 with
 * an exception. The objects stay alive in the engine's `keep`. */
static int gy_py_engine_ranks(PyObject *models, PyObject *kvs, gy_engine_rank *ranks, int32_t *n) {
    const Py_ssize_t size = PySequence_Size(models);
    if (size < 1 || size > GY_MODEL_MAX_TP || PySequence_Size(kvs) != size) {
        PyErr_Clear();
        PyErr_Format(GY_PY_VALUE_ERROR, "a stage needs 1 to %d ranks, as many models as KV caches",
                     GY_MODEL_MAX_TP);
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *m = PySequence_GetItem(models, i), *k = PySequence_GetItem(kvs, i);
        ranks[i].model = m ? gy_py_model_unwrap(m, &ranks[i].pool) : NULL;
        ranks[i].kv = k ? gy_py_kv_unwrap(k) : NULL;
        Py_XDECREF(m); /* kept alive by the engine's `keep` */
        Py_XDECREF(k);
        if (ranks[i].model == NULL || ranks[i].kv == NULL) return -1;
    }
    *n = (int32_t)size;
    return 0;
}

/* A plan of several stages: layers a list of (first, end), models, kvs and comms lists of one
 * entry per stage (each as gy_py_engine_ranks takes, and a Comm or None). The number of stages,
 * or -1 with an exception. */
static Py_ssize_t gy_py_engine_plan(PyObject *layers, PyObject *models, PyObject *kvs,
                                    PyObject *comms, gy_engine_rank ranks[][GY_MODEL_MAX_TP],
                                    gy_engine_stage *stages) {
    const Py_ssize_t n = PySequence_Size(layers);
    if (n < 1 || n > GY_ENGINE_MAX_STAGES || PySequence_Size(models) != n || PySequence_Size(kvs) != n ||
        PySequence_Size(comms) != n) {
        PyErr_Clear();
        PyErr_Format(GY_PY_VALUE_ERROR, "a plan has 1 to %d stages, each with its layers, "
                     "models, KV caches and communicator", GY_ENGINE_MAX_STAGES);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *range = PySequence_GetItem(layers, i), *m = PySequence_GetItem(models, i),
                 *k = PySequence_GetItem(kvs, i), *c = PySequence_GetItem(comms, i);
        long long first = 0, end = 0;
        int ok = range && m && k && c && PyArg_ParseTuple(range, "LL", &first, &end);
        stages[i] = (gy_engine_stage){.first_layer = first, .end_layer = end, .ranks = ranks[i]};
        ok = ok && gy_py_engine_ranks(m, k, ranks[i], &stages[i].size) == 0;
        ok = ok && (c == Py_None || (stages[i].comm = gy_py_comm_unwrap(c)) != NULL);
        Py_XDECREF(range);
        Py_XDECREF(m);
        Py_XDECREF(k);
        Py_XDECREF(c);
        if (!ok) return -1;
    }
    return n;
}

/* Engine(models, kvs, comm, max_batch_tokens, max_running, max_prefill_chunk=0,
 *        watermark_blocks=0, layers=None, span=None): one stage over every layer, models and kvs
 * one entry per TP rank and comm a gyges._C.Comm of that size (None for one rank). With layers,
 * a list of (first, end) per stage, the plan of engine.h: models, kvs and comm are then lists of
 * one entry per stage, each as above. span=(first, end): the layers the plan covers when it is
 * one side of a pipeline split between processes (peer.h). */
static PyObject *gy_py_engine_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"models", "kvs", "comm", "max_batch_tokens", "max_running",
                            "max_prefill_chunk", "watermark_blocks", "layers", "span", NULL};
    PyObject *models, *kvs, *comm_object, *layers = Py_None, *span = Py_None;
    long long max_batch_tokens, max_running, max_prefill_chunk = 0, watermark = 0;
    long long span_first = 0, span_end = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOLL|LLOO", names, &models, &kvs, &comm_object,
                                     &max_batch_tokens, &max_running, &max_prefill_chunk, &watermark,
                                     &layers, &span))
        return NULL;
    if (span != Py_None && !PyArg_ParseTuple(span, "LL", &span_first, &span_end)) return NULL;
    PyObject *keep = Py_BuildValue("(OOO)", models, kvs, comm_object);
    if (keep == NULL) return NULL;
    gy_engine_rank ranks[GY_ENGINE_MAX_STAGES][GY_MODEL_MAX_TP];
    gy_engine_stage stages[GY_ENGINE_MAX_STAGES];
    int32_t n_stages = 1;
    if (layers == Py_None) {
        stages[0] = (gy_engine_stage){.ranks = ranks[0]};
        if (gy_py_engine_ranks(models, kvs, ranks[0], &stages[0].size) < 0) goto fail;
        stages[0].end_layer = ranks[0][0].model->n_layers;
        if (comm_object != Py_None && (stages[0].comm = gy_py_comm_unwrap(comm_object)) == NULL)
            goto fail;
    } else {
        const Py_ssize_t n = gy_py_engine_plan(layers, models, kvs, comm_object, ranks, stages);
        if (n < 0) goto fail;
        n_stages = (int32_t)n;
    }
    const gy_engine_config config = {.max_batch_tokens = max_batch_tokens, .max_running = max_running,
                                     .max_prefill_chunk = max_prefill_chunk,
                                     .watermark_blocks = watermark, .first_layer = span_first,
                                     .end_layer = span_end};
    gy_engine *engine;
    gy_status s = gy_engine_init_plan(&engine, stages, n_stages, &config);
    if (s != GY_OK) {
        Py_DECREF(keep);
        return gy_py_raise(s);
    }
    GyEngineObject *self = (GyEngineObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        gy_engine_free(engine);
        Py_DECREF(keep);
        return NULL;
    }
    self->keep = keep;
    self->engine = engine;
    return (PyObject *)self;
fail:
    Py_DECREF(keep);
    return NULL;
}

static void gy_py_engine_dealloc(GyEngineObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    gy_engine_free(self->engine);
    Py_XDECREF(self->outlet);
    Py_XDECREF(self->transition_keep);
    Py_XDECREF(self->dirty_keep);
    Py_XDECREF(self->keep);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* A request's params from a dict (gyges/runtime/engine.py's engine_params writes it): keys
 * max_new_tokens, temperature, top_k, top_p, min_p, seed, repetition_penalty, frequency_penalty,
 * presence_penalty, min_tokens, logprobs and prompt_logprobs (-1: none), stop_tokens (an int32
 * buffer, borrowed into *stop: release it). 0, or -1 with an exception. */
static int gy_py_engine_params(PyObject *d, gy_engine_params *out, Py_buffer *stop) {
    if (!PyDict_Check(d)) {
        PyErr_SetString(GY_PY_TYPE_ERROR, "params must be a dict");
        return -1;
    }
    static const char *ints[] = {"max_new_tokens", "top_k", "min_tokens", "logprobs",
                                 "prompt_logprobs"};
    static const char *floats[] = {"temperature", "top_p", "min_p", "repetition_penalty",
                                   "frequency_penalty", "presence_penalty"};
    long long iv[5];
    double fv[6];
    for (int i = 0; i < 5; i++) {
        PyObject *v = PyDict_GetItemString(d, ints[i]); /* borrowed */
        if (v == NULL) {
            PyErr_Format(GY_PY_VALUE_ERROR, "params has no %s", ints[i]);
            return -1;
        }
        iv[i] = PyLong_AsLongLong(v);
        if (PyErr_Occurred()) return -1;
    }
    for (int i = 0; i < 6; i++) {
        PyObject *v = PyDict_GetItemString(d, floats[i]);
        if (v == NULL) {
            PyErr_Format(GY_PY_VALUE_ERROR, "params has no %s", floats[i]);
            return -1;
        }
        fv[i] = PyFloat_AsDouble(v);
        if (PyErr_Occurred()) return -1;
    }
    PyObject *seed = PyDict_GetItemString(d, "seed"), *stops = PyDict_GetItemString(d, "stop_tokens");
    if (seed == NULL || stops == NULL) {
        PyErr_SetString(GY_PY_VALUE_ERROR, "params needs seed and stop_tokens");
        return -1;
    }
    const unsigned long long seed_value = PyLong_AsUnsignedLongLong(seed);
    if (PyErr_Occurred()) return -1;
    if (PyObject_GetBuffer(stops, stop, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (iv[3] < -1 || iv[3] > GY_LOGPROBS_MAX || iv[4] < -1 || iv[4] > GY_LOGPROBS_MAX) {
        PyBuffer_Release(stop);
        PyErr_SetString(GY_PY_VALUE_ERROR, "logprobs and prompt_logprobs are -1 or in [0, 20]");
        return -1;
    }
    *out = (gy_engine_params){
        .sampler = {.temperature = fv[0], .top_p = fv[1], .top_k = iv[1], .seed = seed_value,
                    .min_p = fv[2], .repetition_penalty = fv[3], .frequency_penalty = fv[4],
                    .presence_penalty = fv[5]},
        .max_new_tokens = iv[0],
        .stop_tokens = stop->buf,
        .n_stop_tokens = stop->len / 4,
        .min_tokens = iv[2],
        .logprobs_top = iv[3] > 0 ? (int32_t)iv[3] : 0,
        .prompt_logprobs = iv[4] >= 0,
        .prompt_logprobs_top = iv[4] > 0 ? (int32_t)iv[4] : 0,
    };
    return 0;
}

/* The dict gy_py_engine_params reads, from a request's params (stop_tokens as int32 bytes). */
static PyObject *gy_py_engine_params_dict(const gy_engine_params *p) {
    return Py_BuildValue("{sLsdsLsdsdsKsdsdsdsLsisisy#}", "max_new_tokens",
                         (long long)p->max_new_tokens, "temperature", p->sampler.temperature,
                         "top_k", (long long)p->sampler.top_k, "top_p", p->sampler.top_p, "min_p",
                         p->sampler.min_p, "seed", (unsigned long long)p->sampler.seed,
                         "repetition_penalty", p->sampler.repetition_penalty, "frequency_penalty",
                         p->sampler.frequency_penalty, "presence_penalty",
                         p->sampler.presence_penalty, "min_tokens", (long long)p->min_tokens,
                         "logprobs", (int)p->logprobs_top, "prompt_logprobs",
                         p->prompt_logprobs ? (int)p->prompt_logprobs_top : -1,
                         "stop_tokens", (const char *)p->stop_tokens,
                         (Py_ssize_t)(p->n_stop_tokens * 4));
}

/* add(id, prompt_int32, params, arrival): params as gy_py_engine_params reads them */
static PyObject *gy_py_engine_add_request(GyEngineObject *self, PyObject *args) {
    long long id;
    double arrival;
    PyObject *prompt_object, *params_object;
    if (!PyArg_ParseTuple(args, "LOOd", &id, &prompt_object, &params_object, &arrival)) return NULL;
    Py_buffer prompt, stop;
    gy_engine_params params;
    if (PyObject_GetBuffer(prompt_object, &prompt, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (gy_py_engine_params(params_object, &params, &stop) < 0) {
        PyBuffer_Release(&prompt);
        return NULL;
    }
    gy_status s = gy_engine_add(self->engine, id, prompt.buf, prompt.len / 4, &params, arrival);
    PyBuffer_Release(&prompt);
    PyBuffer_Release(&stop);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

/* A scored token: (logprob, rank, ((token, logprob), ...) of the top n_top). */
static PyObject *gy_py_engine_logprobs(const gy_logprobs *lp) {
    PyObject *top = PyTuple_New(lp->n_top);
    for (int32_t j = 0; top != NULL && j < lp->n_top; j++) {
        PyObject *pair = Py_BuildValue("(id)", (int)lp->top_tokens[j], lp->top_logprobs[j]);
        if (pair == NULL) Py_CLEAR(top);
        else PyTuple_SET_ITEM(top, j, pair);
    }
    if (top == NULL) return NULL;
    return Py_BuildValue("(dLN)", lp->logprob, (long long)lp->rank, top);
}

/* step(now) -> (tokens, finished [id], batch_tokens, preempted, prompt):
 *   tokens [(id, token, (logprob, rank, top))], one per sampled token in entry order;
 *   prompt [(id, position, (logprob, rank, top))], one per scored prompt position;
 *   top: ((token, logprob), ...) most likely first, as many as the request asked for (engine.h). */
static PyObject *gy_py_engine_step(GyEngineObject *self, PyObject *args) {
    double now;
    if (!PyArg_ParseTuple(args, "d", &now)) return NULL;
    gy_engine_step_out out;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_engine_step(self->engine, now, &out);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    PyObject *tokens = PyList_New(out.n_tokens);
    PyObject *finished = PyList_New(out.n_finished);
    PyObject *prompt = PyList_New(out.n_prompt);
    if (tokens == NULL || finished == NULL || prompt == NULL) goto fail;
    for (int64_t i = 0; i < out.n_tokens; i++) {
        PyObject *lp = gy_py_engine_logprobs(&out.logprobs[i]);
        if (lp == NULL) goto fail;
        PyObject *row = Py_BuildValue("(LiN)", (long long)out.token_ids[i], (int)out.tokens[i], lp);
        if (row == NULL) goto fail;
        PyList_SET_ITEM(tokens, i, row);
    }
    for (int64_t i = 0; i < out.n_prompt; i++) {
        PyObject *lp = gy_py_engine_logprobs(&out.prompt_logprobs[i]);
        if (lp == NULL) goto fail;
        PyObject *row = Py_BuildValue("(LiN)", (long long)out.prompt_ids[i], (int)out.prompt_pos[i], lp);
        if (row == NULL) goto fail;
        PyList_SET_ITEM(prompt, i, row);
    }
    for (int64_t i = 0; i < out.n_finished; i++) {
        PyObject *id = PyLong_FromLongLong(out.finished[i]);
        if (id == NULL) goto fail;
        PyList_SET_ITEM(finished, i, id);
    }
    return Py_BuildValue("(NNLLN)", tokens, finished, (long long)out.n_batch_tokens,
                         (long long)out.n_preempted, prompt);
fail:
    Py_XDECREF(tokens);
    Py_XDECREF(finished);
    Py_XDECREF(prompt);
    return NULL;
}

static PyObject *gy_py_engine_abort(GyEngineObject *self, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    gy_status s = gy_engine_abort(self->engine, id);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_release(GyEngineObject *self, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    gy_status s = gy_engine_release(self->engine, id);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_info(GyEngineObject *self, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    gy_sched_info info;
    char error[1024];
    gy_status s = gy_engine_info(self->engine, id, &info, error, sizeof error);
    if (s != GY_OK) return gy_py_raise(s);
    return Py_BuildValue("{sssssssLsLsLsdsdsdsd}", "error", error, "state", gy_sched_state_name(info.state),
                         "finish", gy_sched_finish_name(info.finish), "n_generated",
                         (long long)info.n_generated, "n_computed", (long long)info.n_computed,
                         "n_preemptions", (long long)info.n_preemptions, "arrival", info.arrival,
                         "first_scheduled", info.first_scheduled, "first_token", info.first_token,
                         "finished_at", info.finished_at);
}

static PyObject *gy_py_engine_stats(GyEngineObject *self, PyObject *unused) {
    gy_sched_stats st;
    gy_engine_stats(self->engine, &st);
    return Py_BuildValue("{sLsLsLsLsLsLsL}", "waiting", (long long)st.n_waiting, "preempted_queued",
                         (long long)st.n_preempted, "running", (long long)st.n_running, "finished",
                         (long long)st.n_finished, "steps", (long long)st.n_steps, "preemptions",
                         (long long)st.n_preemptions, "capacity_blocks",
                         (long long)gy_engine_capacity_blocks(self->engine));
}

static PyObject *gy_py_engine_hold(GyEngineObject *self, PyObject *args) {
    int held;
    if (!PyArg_ParseTuple(args, "p", &held)) return NULL;
    gy_engine_hold(self->engine, held);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_request_ids(GyEngineObject *self, PyObject *unused) {
    const int64_t n = gy_engine_request_ids(self->engine, NULL, 0);
    int64_t *ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *ids);
    if (ids == NULL) return PyErr_NoMemory();
    gy_engine_request_ids(self->engine, ids, n);
    PyObject *list = PyList_New(n);
    for (int64_t i = 0; list != NULL && i < n; i++) {
        PyObject *v = PyLong_FromLongLong(ids[i]);
        if (v == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, v);
    }
    free(ids);
    return list;
}

static PyObject *gy_py_engine_info_dict(const gy_sched_info *info) {
    return Py_BuildValue("{sisssLsLsLsLsdsdsd}", "state_id", (int)info->state, "state",
                         gy_sched_state_name(info->state), "n_generated", (long long)info->n_generated,
                         "n_computed", (long long)info->n_computed, "prefill_end",
                         (long long)info->prefill_end, "n_preemptions", (long long)info->n_preemptions,
                         "arrival", info->arrival, "first_scheduled", info->first_scheduled,
                         "first_token", info->first_token);
}

/* export(id) -> dict: tokens (int32 bytes), prompt_len, params (gy_py_engine_params's dict,
 * stop_tokens int32 bytes), info, seqs per rank */
static PyObject *gy_py_engine_export(GyEngineObject *self, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    gy_engine_request_view v;
    gy_status s = gy_engine_request_get(self->engine, id, &v);
    if (s != GY_OK) return gy_py_raise(s);
    const int32_t n_ranks = gy_engine_n_ranks(self->engine);
    PyObject *seqs = PyList_New(n_ranks);
    if (seqs == NULL) return NULL;
    for (int32_t i = 0; i < n_ranks; i++) {
        PyObject *x = PyLong_FromLongLong(v.seqs[i]);
        if (x == NULL) {
            Py_DECREF(seqs);
            return NULL;
        }
        PyList_SET_ITEM(seqs, i, x);
    }
    PyObject *params = gy_py_engine_params_dict(&v.params);
    if (params == NULL) {
        Py_DECREF(seqs);
        return NULL;
    }
    return Py_BuildValue("{sy#sLsNsNsN}", "tokens", (const char *)v.tokens,
                         (Py_ssize_t)(v.n_tokens * 4), "prompt_len", (long long)v.prompt_len,
                         "params", params, "info", gy_py_engine_info_dict(&v.info), "seqs", seqs);
}

/* The engine's own type, to recognise another Engine (heap types differ per module). */
static PyObject *gy_py_engine_type;

/* take(src, id, seqs): moves request `id` from Engine `src` here with its progress and KV
 * (gy_engine_take); seqs: its sequence in each rank's cache here, -1 for none. */
enum { GY_PY_MAX_SEQS = GY_ENGINE_MAX_STAGES * GY_MODEL_MAX_TP }; /* every rank of a plan */

/* A request's KV sequence per rank, from a Python sequence of ints (the rest -1); -1 with an
 * exception set when it is not one. */
static int gy_py_engine_seqs(PyObject *seqs_object, int64_t seqs[GY_PY_MAX_SEQS]) {
    for (int i = 0; i < GY_PY_MAX_SEQS; i++) seqs[i] = -1;
    PyObject *seq = gy_py_sequence(seqs_object, "seqs must be a sequence of ints");
    if (seq == NULL) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n && i < GY_PY_MAX_SEQS; i++)
        seqs[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
    if (PyErr_Occurred()) return -1;
    if (n > GY_PY_MAX_SEQS) {
        PyErr_Format(GY_PY_VALUE_ERROR, "seqs has %zd entries, at most %d", n, GY_PY_MAX_SEQS);
        return -1;
    }
    return 0;
}

/* attach_kv(id, seqs): the request's KV sequence on every rank again (a rollback). */
static PyObject *gy_py_engine_attach_kv(GyEngineObject *self, PyObject *args) {
    PyObject *seqs_object;
    long long id;
    if (!PyArg_ParseTuple(args, "LO", &id, &seqs_object)) return NULL;
    int64_t seqs[GY_PY_MAX_SEQS];
    if (gy_py_engine_seqs(seqs_object, seqs) != 0) return NULL;
    const gy_status s = gy_engine_attach_kv(self->engine, id, seqs);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_take(GyEngineObject *self, PyObject *args) {
    PyObject *src_object, *seqs_object, *as_object = Py_None;
    long long id;
    if (!PyArg_ParseTuple(args, "OLO|O", &src_object, &id, &seqs_object, &as_object)) return NULL;
    /* as: (state, G, C, E, preemptions, arrival, first_scheduled, first_token), or None */
    gy_sched_info as = {0};
    if (as_object != Py_None) {
        int state;
        long long G, C, E, preemptions;
        if (!PyArg_ParseTuple(as_object, "iLLLLddd", &state, &G, &C, &E, &preemptions,
                              &as.arrival, &as.first_scheduled, &as.first_token))
            return NULL;
        as.state = (gy_sched_state)state;
        as.n_generated = G, as.n_computed = C, as.prefill_end = E, as.n_preemptions = preemptions;
    }
    if (!PyObject_TypeCheck(src_object, (PyTypeObject *)gy_py_engine_type))
        return PyErr_Format(GY_PY_TYPE_ERROR, "src must be a gyges._C.Engine, not %s",
                            Py_TYPE(src_object)->tp_name);
    int64_t seqs[GY_PY_MAX_SEQS];
    if (gy_py_engine_seqs(seqs_object, seqs) != 0) return NULL;
    gy_status s;
    gy_engine *src = ((GyEngineObject *)src_object)->engine;
    Py_BEGIN_ALLOW_THREADS
    s = gy_engine_take_as(self->engine, src, id, seqs, as_object != Py_None ? &as : NULL);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

/* adopt(id, tokens, prompt_len, params (as add takes them),
 *       (state_id, n_generated, n_computed, prefill_end, n_preemptions, arrival,
 *        first_scheduled, first_token), seqs) */
static PyObject *gy_py_engine_adopt(GyEngineObject *self, PyObject *args) {
    long long id, prompt_len, G, C, E, preemptions;
    double arrival, first_scheduled, first_token;
    int state;
    PyObject *tokens_object, *params_object, *seqs_object;
    if (!PyArg_ParseTuple(args, "LOLO(iLLLLddd)O", &id, &tokens_object, &prompt_len,
                          &params_object, &state, &G, &C, &E, &preemptions, &arrival,
                          &first_scheduled, &first_token, &seqs_object))
        return NULL;
    int64_t seqs[GY_MODEL_MAX_TP];
    for (int i = 0; i < GY_MODEL_MAX_TP; i++) seqs[i] = -1;
    const Py_ssize_t n_seqs = PySequence_Size(seqs_object);
    if (n_seqs < 0 || n_seqs > GY_MODEL_MAX_TP) return PyErr_Format(GY_PY_VALUE_ERROR, "bad seqs");
    for (Py_ssize_t i = 0; i < n_seqs; i++) {
        PyObject *x = PySequence_GetItem(seqs_object, i);
        seqs[i] = x ? PyLong_AsLongLong(x) : -1;
        Py_XDECREF(x);
        if (PyErr_Occurred()) return NULL;
    }
    Py_buffer tokens, stop;
    gy_engine_params params;
    if (PyObject_GetBuffer(tokens_object, &tokens, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (gy_py_engine_params(params_object, &params, &stop) < 0) {
        PyBuffer_Release(&tokens);
        return NULL;
    }
    const gy_sched_info info = {.state = (gy_sched_state)state, .prompt_len = prompt_len,
                                .max_new_tokens = params.max_new_tokens, .n_generated = G, .n_computed = C,
                                .prefill_end = E, .n_preemptions = preemptions, .arrival = arrival,
                                .first_scheduled = first_scheduled, .first_token = first_token};
    gy_status s = gy_engine_adopt(self->engine, id, tokens.buf, tokens.len / 4, prompt_len, &params,
                                  &info, seqs);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&stop);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

/* transition_begin(old_models, old_kvs, groups): per engine rank its old model and KV cache;
 * groups: a list of (ranks tuple, Comm or None). */
static PyObject *gy_py_engine_transition_begin(GyEngineObject *self, PyObject *args) {
    PyObject *models, *kvs, *groups;
    int groups_last = 0;
    if (!PyArg_ParseTuple(args, "OOO|p", &models, &kvs, &groups, &groups_last)) return NULL;
    const int32_t n = gy_engine_n_ranks(self->engine);
    if (PySequence_Size(models) != n || PySequence_Size(kvs) != n)
        return PyErr_Format(GY_PY_VALUE_ERROR, "need an old model and KV cache for each of %d ranks", (int)n);
    PyObject *keep = Py_BuildValue("(OOO)", models, kvs, groups);
    if (keep == NULL) return NULL;
    gy_engine_rank old[GY_MODEL_MAX_TP];
    gy_engine_old_group grps[GY_MODEL_MAX_TP];
    const Py_ssize_t n_groups = PySequence_Size(groups);
    if (n_groups < 1 || n_groups > n) {
        Py_DECREF(keep);
        return PyErr_Format(GY_PY_VALUE_ERROR, "between 1 and %d old groups", (int)n);
    }
    for (int32_t i = 0; i < n; i++) {
        PyObject *m = PySequence_GetItem(models, i), *k = PySequence_GetItem(kvs, i);
        old[i].model = m ? gy_py_model_unwrap(m, &old[i].pool) : NULL;
        old[i].kv = k ? gy_py_kv_unwrap(k) : NULL;
        Py_XDECREF(m);
        Py_XDECREF(k);
        if (old[i].model == NULL || old[i].kv == NULL) {
            Py_DECREF(keep);
            return NULL;
        }
    }
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        PyObject *item = PySequence_GetItem(groups, g), *ranks = NULL, *comm = NULL;
        int ok = item && PyArg_ParseTuple(item, "OO", &ranks, &comm);
        Py_ssize_t size = ok ? PySequence_Size(ranks) : -1;
        ok = ok && size >= 1 && size <= GY_MODEL_MAX_TP;
        grps[g].size = (int32_t)size;
        grps[g].comm = NULL;
        for (Py_ssize_t j = 0; ok && j < size; j++) {
            PyObject *r = PySequence_GetItem(ranks, j);
            grps[g].ranks[j] = r ? (int32_t)PyLong_AsLong(r) : -1;
            Py_XDECREF(r);
            ok = !PyErr_Occurred();
        }
        if (ok && comm != Py_None) ok = (grps[g].comm = gy_py_comm_unwrap(comm)) != NULL;
        Py_XDECREF(item);
        if (!ok) {
            Py_DECREF(keep);
            if (!PyErr_Occurred()) PyErr_SetString(GY_PY_VALUE_ERROR, "a group is (ranks, comm)");
            return NULL;
        }
    }
    gy_status s = gy_engine_transition_begin(self->engine, old, grps, (int32_t)n_groups, groups_last);
    if (s != GY_OK) {
        Py_DECREF(keep);
        return gy_py_raise(s);
    }
    Py_XSETREF(self->transition_keep, keep);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_transition_adopt(GyEngineObject *self, PyObject *args) {
    long long id;
    int group;
    PyObject *seqs_object;
    if (!PyArg_ParseTuple(args, "LiO", &id, &group, &seqs_object)) return NULL;
    int64_t seqs[GY_MODEL_MAX_TP];
    const Py_ssize_t n = PySequence_Size(seqs_object);
    if (n < 0 || n > GY_MODEL_MAX_TP) return PyErr_Format(GY_PY_VALUE_ERROR, "bad old sequences");
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PySequence_GetItem(seqs_object, i);
        seqs[i] = x ? PyLong_AsLongLong(x) : -1;
        Py_XDECREF(x);
        if (PyErr_Occurred()) return NULL;
    }
    gy_status s = gy_engine_transition_adopt(self->engine, id, group, seqs);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_transition_set_boundary(GyEngineObject *self, PyObject *args) {
    long long b;
    if (!PyArg_ParseTuple(args, "L", &b)) return NULL;
    gy_status s = gy_engine_transition_set_boundary(self->engine, b);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_transition_seq(GyEngineObject *self, PyObject *args) {
    long long id;
    int rank;
    if (!PyArg_ParseTuple(args, "Li", &id, &rank)) return NULL;
    int32_t group;
    int64_t seq;
    gy_status s = gy_engine_transition_seq(self->engine, id, rank, &group, &seq);
    if (s != GY_OK) return gy_py_raise(s);
    return Py_BuildValue("(iL)", (int)group, (long long)seq);
}

/* transition_table() -> [(id, new seqs per rank, (group, old seq) per rank)] for every unfinished
 * request: what a layer move plans from, in one call instead of one per request and rank. */
static PyObject *gy_py_engine_transition_table(GyEngineObject *self, PyObject *unused) {
    const int64_t n = gy_engine_request_ids(self->engine, NULL, 0);
    const int32_t R = gy_engine_n_ranks(self->engine);
    int64_t *ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *ids);
    if (ids == NULL) return PyErr_NoMemory();
    gy_engine_request_ids(self->engine, ids, n);
    PyObject *list = PyList_New(n);
    for (int64_t i = 0; list != NULL && i < n; i++) {
        gy_engine_request_view view;
        gy_status s = gy_engine_request_get(self->engine, ids[i], &view);
        PyObject *seqs = s == GY_OK ? PyTuple_New(R) : NULL, *olds = seqs ? PyTuple_New(R) : NULL;
        for (int32_t r = 0; olds != NULL && r < R; r++) {
            int32_t group;
            int64_t seq;
            s = gy_engine_transition_seq(self->engine, ids[i], r, &group, &seq);
            if (s != GY_OK) break;
            PyTuple_SET_ITEM(seqs, r, PyLong_FromLongLong(view.seqs[r]));
            PyTuple_SET_ITEM(olds, r, Py_BuildValue("(iL)", (int)group, (long long)seq));
        }
        PyObject *row = s == GY_OK && olds ? Py_BuildValue("(LOO)", (long long)ids[i], seqs, olds) : NULL;
        Py_XDECREF(seqs);
        Py_XDECREF(olds);
        if (row == NULL) {
            if (s != GY_OK && !PyErr_Occurred()) gy_py_raise(s);
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, row);
    }
    free(ids);
    return list;
}

static PyObject *gy_py_engine_transition_end(GyEngineObject *self, PyObject *unused) {
    gy_status s = gy_engine_transition_end(self->engine);
    if (s != GY_OK) return gy_py_raise(s);
    Py_CLEAR(self->transition_keep);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_transition_detach(GyEngineObject *self, PyObject *unused) {
    gy_engine_transition_detach(self->engine);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_transition_abort(GyEngineObject *self, PyObject *unused) {
    gy_engine_transition_abort(self->engine);
    Py_CLEAR(self->transition_keep);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_transition_boundary(GyEngineObject *self, PyObject *unused) {
    return PyLong_FromLongLong(gy_engine_transition_boundary(self->engine));
}

static PyObject *gy_py_engine_detach_kv(GyEngineObject *self, PyObject *unused) {
    gy_engine_detach_kv(self->engine);
    Py_RETURN_NONE;
}

/* set_dirty(stage, rank, dirty): steps mark the KV slots they write there (None stops). */
static PyObject *gy_py_engine_set_dirty(GyEngineObject *self, PyObject *args) {
    int stage, rank;
    PyObject *dirty_object;
    if (!PyArg_ParseTuple(args, "iiO", &stage, &rank, &dirty_object)) return NULL;
    struct gy_kv_dirty *d = NULL;
    if (dirty_object != Py_None && (d = gy_py_dirty_unwrap(dirty_object)) == NULL) return NULL;
    if (self->dirty_keep == NULL && (self->dirty_keep = PyDict_New()) == NULL) return NULL;
    PyObject *key = Py_BuildValue("(ii)", stage, rank);
    if (key == NULL) return NULL;
    gy_status s = gy_engine_set_dirty(self->engine, stage, rank, d);
    int failed = s != GY_OK;
    if (!failed)
        failed = d ? PyDict_SetItem(self->dirty_keep, key, dirty_object) < 0
                   : (PyDict_Contains(self->dirty_keep, key) == 1 && PyDict_DelItem(self->dirty_keep, key) < 0);
    Py_DECREF(key);
    if (s != GY_OK) return gy_py_raise(s);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* stage_pairs(src_stage, dst_stage, rank) -> [(src_seq, dst_seq)]: the sequences of every
 * request holding KV on rank `rank` of both stages (the copies between them are KV moves). */
static PyObject *gy_py_engine_stage_pairs(GyEngineObject *self, PyObject *args) {
    int src, dst, rank;
    if (!PyArg_ParseTuple(args, "iii", &src, &dst, &rank)) return NULL;
    int64_t *pairs = NULL, cap = 0, n = 0;
    gy_status s;
    for (;;) { /* again with more room when there were more pairs than it had */
        Py_BEGIN_ALLOW_THREADS
        s = gy_engine_stage_pairs(self->engine, src, dst, rank, pairs, cap, &n);
        Py_END_ALLOW_THREADS
        if (s != GY_OK || n <= cap) break;
        PyMem_Free(pairs);
        cap = n + 8;
        if ((pairs = PyMem_Malloc((size_t)(2 * cap) * sizeof *pairs)) == NULL) return PyErr_NoMemory();
    }
    PyObject *list = s == GY_OK ? PyList_New((Py_ssize_t)n) : gy_py_raise(s);
    for (int64_t i = 0; list != NULL && i < n; i++) {
        PyObject *pair = Py_BuildValue("(LL)", (long long)pairs[2 * i], (long long)pairs[2 * i + 1]);
        if (pair == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)i, pair);
    }
    PyMem_Free(pairs);
    return list;
}

static PyObject *gy_py_engine_stage_seq(GyEngineObject *self, PyObject *args) {
    int stage, rank;
    long long id;
    if (!PyArg_ParseTuple(args, "iiL", &stage, &rank, &id)) return NULL;
    return PyLong_FromLongLong(gy_engine_stage_seq(self->engine, stage, rank, id));
}

/* set_remote(id, stage, src_stage, first_layer, end_layer): the request's attention in those
 * layers of `stage` runs on src_stage's ranks (an empty range ends it). */
static PyObject *gy_py_engine_set_remote(GyEngineObject *self, PyObject *args) {
    int stage, src;
    long long id, first, end;
    if (!PyArg_ParseTuple(args, "LiiLL", &id, &stage, &src, &first, &end)) return NULL;
    const gy_status s = gy_engine_set_remote(self->engine, id, stage, src, first, end);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_remote_stats(GyEngineObject *self, PyObject *unused) {
    (void)unused;
    int64_t calls = 0, token_layers = 0;
    gy_engine_remote_stats(self->engine, &calls, &token_layers);
    return Py_BuildValue("{s:L,s:L}", "calls", (long long)calls, "token_layers",
                         (long long)token_layers);
}

/* replan(layers, models): the same stages and KV caches, new (first, end) ranges and models (a
 * list per stage, one model per rank). */
static PyObject *gy_py_engine_replan(GyEngineObject *self, PyObject *args) {
    PyObject *layers, *models;
    if (!PyArg_ParseTuple(args, "OO", &layers, &models)) return NULL;
    PyObject *kvs = PyTuple_GET_ITEM(self->keep, 1), *comms = PyTuple_GET_ITEM(self->keep, 2);
    gy_engine_rank ranks[GY_ENGINE_MAX_STAGES][GY_MODEL_MAX_TP];
    gy_engine_stage stages[GY_ENGINE_MAX_STAGES];
    const Py_ssize_t n = gy_py_engine_plan(layers, models, kvs, comms, ranks, stages);
    if (n < 0) return NULL;
    PyObject *keep = Py_BuildValue("(OOO)", models, kvs, comms);
    if (keep == NULL) return NULL;
    gy_status s = gy_engine_replan(self->engine, stages, (int32_t)n);
    if (s != GY_OK) {
        Py_DECREF(keep);
        return gy_py_raise(s);
    }
    Py_SETREF(self->keep, keep);
    Py_RETURN_NONE;
}

/* ---- a pipeline split between processes (peer.h) ---- */

/* A step as plain data: a dict of bytes (int64 ids, pos, n_tokens; int32 tokens, logit_rows;
 * float32 x [rows, hidden]; int64 released) and the release counts. */
static PyObject *gy_py_peer_step_dict(const gy_peer_step *st, int64_t hidden) {
    /* (y# makes None of a NULL pointer: an empty column is b"") */
#define GY_PY_COLUMN(p, n, size) ((n) > 0 ? (const char *)(p) : ""), (Py_ssize_t)((n) * (size))
    const int64_t n_rel = st->n_released_before + st->n_released_now;
    return Py_BuildValue(
        "{s:L,s:i,s:y#,s:y#,s:y#,s:y#,s:y#,s:y#,s:y#,s:L,s:L}",
        "number", (long long)st->number, "cancel", (int)st->cancel,
        "ids", GY_PY_COLUMN(st->ids, st->n_entries, 8),
        "pos", GY_PY_COLUMN(st->pos, st->n_entries, 8),
        "n_tokens", GY_PY_COLUMN(st->n_tokens, st->n_entries, 8),
        "tokens", GY_PY_COLUMN(st->tokens, st->n_rows, 4),
        "logit_rows", GY_PY_COLUMN(st->logit_rows, st->n_logits, 4),
        "x", GY_PY_COLUMN(st->x, st->n_rows * hidden, 4),
        "released", GY_PY_COLUMN(st->released, n_rel, 8),
        "n_released_before", (long long)st->n_released_before,
        "n_released_now", (long long)st->n_released_now);
#undef GY_PY_COLUMN
}

/* The leader's outlet: calls the Python function with the step (a dict) from the stepping
 * thread; it returns the logits as a float32 buffer (anything for a cancel). */
static gy_status gy_py_outlet(void *ctx, const gy_peer_step *step, float *logits) {
    GyEngineObject *self = ctx;   /* (the engine calls it, so self is alive) */
    PyGILState_STATE gil = PyGILState_Ensure();
    gy_status s = GY_OK;
    const int64_t V = gy_engine_vocab(self->engine);
    PyObject *arg = gy_py_peer_step_dict(step, gy_engine_hidden(self->engine));
    PyObject *r = arg ? PyObject_CallOneArg(self->outlet, arg) : NULL;
    Py_XDECREF(arg);
    if (r != NULL && !step->cancel) {
        Py_buffer out;
        if (PyObject_GetBuffer(r, &out, PyBUF_C_CONTIGUOUS) == 0) {
            if (out.len != (Py_ssize_t)(step->n_logits * V * 4))
                s = GY_FAIL(GY_ERR_STATE, "the follower returned %lld bytes of logits, not %lld",
                            (long long)out.len, (long long)(step->n_logits * V * 4));
            else if (out.len > 0)
                memcpy(logits, out.buf, (size_t)out.len);
            PyBuffer_Release(&out);
        }
    }
    Py_XDECREF(r);
    if (PyErr_Occurred()) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *text = value ? PyObject_Str(value) : NULL;
        const char *m = text ? PyUnicode_AsUTF8(text) : NULL;
        s = GY_FAIL(GY_ERR_STATE, "the follower: %s", m ? m : "an exception");
        PyErr_Clear();
        Py_XDECREF(text);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    PyGILState_Release(gil);
    return s;
}

/* set_outlet(fn, peer_capacity): fn(step dict) -> float32 logits buffer; fn None detaches the
 * follower. */
static PyObject *gy_py_engine_set_outlet(GyEngineObject *self, PyObject *args) {
    PyObject *fn;
    long long capacity;
    if (!PyArg_ParseTuple(args, "OL", &fn, &capacity)) return NULL;
    if (fn != Py_None && !PyCallable_Check(fn))
        return PyErr_Format(GY_PY_VALUE_ERROR, "the outlet must be callable");
    /* (the engine's lock orders this with a step that may be calling the old outlet: the new
     * one is in place before the engine can call it, the old one kept until it cannot) */
    PyObject *old = self->outlet;
    self->outlet = fn == Py_None ? NULL : Py_NewRef(fn);
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_engine_set_outlet(self->engine, fn == Py_None ? NULL : gy_py_outlet, self, capacity);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) {
        Py_XDECREF(self->outlet);
        self->outlet = old;
        return gy_py_raise(s);
    }
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* One bytes entry of a step dict, its length checked to be n elements of `size` bytes. */
static int gy_py_step_field(PyObject *d, const char *key, Py_ssize_t size, Py_buffer *out) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (v == NULL) {
        PyErr_Format(GY_PY_VALUE_ERROR, "step has no %s", key);
        return -1;
    }
    if (PyObject_GetBuffer(v, out, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (out->len % size) {
        PyBuffer_Release(out);
        PyErr_Format(GY_PY_VALUE_ERROR, "step %s: %zd bytes, not whole %zd-byte items", key,
                     out->len, size);
        return -1;
    }
    return 0;
}

/* follow(step dict) -> logits bytes (float32 [n_logits, vocab]; b"" for a cancel). */
static PyObject *gy_py_engine_follow(GyEngineObject *self, PyObject *arg) {
    gy_status s;
    if (!PyDict_Check(arg)) return PyErr_Format(GY_PY_VALUE_ERROR, "step must be a dict");
    static const char *keys[] = {"ids", "pos", "n_tokens", "tokens", "logit_rows", "x", "released"};
    static const Py_ssize_t sizes[] = {8, 8, 8, 4, 4, 4, 8};
    Py_buffer b[7];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 7; got++)
        if (gy_py_step_field(arg, keys[got], sizes[got], &b[got]) < 0) goto done;
    PyObject *before = PyDict_GetItemString(arg, "n_released_before");
    PyObject *now = PyDict_GetItemString(arg, "n_released_now");
    PyObject *number = PyDict_GetItemString(arg, "number");
    PyObject *cancel = PyDict_GetItemString(arg, "cancel");
    const long long n_before = before ? PyLong_AsLongLong(before) : -1;
    const long long n_now = now ? PyLong_AsLongLong(now) : -1;
    const long long n_step = number ? PyLong_AsLongLong(number) : -1;
    const int cancelled = cancel ? PyObject_IsTrue(cancel) : -1;
    if (PyErr_Occurred()) goto done;
    const int64_t n_entries = b[0].len / 8, n_rows = b[3].len / 4, n_logits = b[4].len / 4;
    const int64_t hidden = gy_engine_hidden(self->engine), vocab = gy_engine_vocab(self->engine);
    if (b[1].len / 8 != n_entries || b[2].len / 8 != n_entries || b[5].len / 4 != n_rows * hidden ||
        n_before < 0 || n_now < 0 || n_before + n_now != b[6].len / 8 || n_step < 0 ||
        cancelled < 0) {
        PyErr_Format(GY_PY_VALUE_ERROR, "step: columns of different lengths");
        goto done;
    }
    const gy_peer_step st = {.number = n_step, .cancel = cancelled, .n_entries = n_entries, .ids = b[0].buf, .pos = b[1].buf,
                             .n_tokens = b[2].buf, .n_rows = n_rows, .tokens = b[3].buf,
                             .n_logits = n_logits, .logit_rows = b[4].buf, .x = b[5].buf,
                             .n_released_before = n_before, .n_released_now = n_now,
                             .released = b[6].buf};
    PyObject *logits = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n_logits * vocab * 4));
    if (logits == NULL) goto done;
    float *out = (float *)PyBytes_AS_STRING(logits);
    Py_BEGIN_ALLOW_THREADS
    s = gy_engine_follow(self->engine, &st, out);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) {
        Py_DECREF(logits);
        gy_py_raise(s);
        goto done;
    }
    result = logits;
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    return result;
}

/* follow_adopt(id, seqs): the follower's request `id` holds seqs[k] on rank k. */
static PyObject *gy_py_engine_follow_adopt(GyEngineObject *self, PyObject *args) {
    long long id;
    PyObject *seqs_object;
    if (!PyArg_ParseTuple(args, "LO", &id, &seqs_object)) return NULL;
    int64_t seqs[GY_ENGINE_MAX_STAGES * GY_MODEL_MAX_TP];
    const Py_ssize_t n = PySequence_Size(seqs_object);
    if (n < 0 || n > GY_ENGINE_MAX_STAGES * GY_MODEL_MAX_TP)
        return PyErr_Format(GY_PY_VALUE_ERROR, "bad seqs");
    int64_t have[GY_ENGINE_MAX_STAGES * GY_MODEL_MAX_TP];
    if (n != gy_engine_follow_seqs(self->engine, id, have))
        return PyErr_Format(GY_PY_VALUE_ERROR, "seqs: one per rank of the plan");
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PySequence_GetItem(seqs_object, i);
        seqs[i] = x ? PyLong_AsLongLong(x) : -1;
        Py_XDECREF(x);
        if (PyErr_Occurred()) return NULL;
    }
    const gy_status s = gy_engine_follow_adopt(self->engine, id, seqs);
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

/* follow_seqs(id) -> [seq per rank] (-1 where none). */
static PyObject *gy_py_engine_follow_seqs(GyEngineObject *self, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    int64_t seqs[GY_ENGINE_MAX_STAGES * GY_MODEL_MAX_TP];
    const int32_t n = gy_engine_follow_seqs(self->engine, id, seqs);
    PyObject *out = PyList_New(n);
    for (int32_t k = 0; out != NULL && k < n; k++) {
        PyObject *v = PyLong_FromLongLong(seqs[k]);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, k, v);
    }
    return out;
}

static PyObject *gy_py_engine_follow_forget(GyEngineObject *self, PyObject *args) {
    long long id;
    if (!PyArg_ParseTuple(args, "L", &id)) return NULL;
    gy_engine_follow_forget(self->engine, id);
    Py_RETURN_NONE;
}

static PyObject *gy_py_engine_peer_flush(GyEngineObject *self, PyObject *unused) {
    (void)unused;
    gy_status s;
    Py_BEGIN_ALLOW_THREADS
    s = gy_engine_peer_flush(self->engine);
    Py_END_ALLOW_THREADS
    if (s != GY_OK) return gy_py_raise(s);
    Py_RETURN_NONE;
}

static PyMethodDef gy_py_engine_methods[] = {
    {"peer_flush", (PyCFunction)gy_py_engine_peer_flush, METH_NOARGS,
     "peer_flush(): the follower frees what the leader released"},
    {"set_outlet", (PyCFunction)gy_py_engine_set_outlet, METH_VARARGS,
     "set_outlet(fn, peer_capacity): the follower of a plan that ends early (peer.h)"},
    {"follow", (PyCFunction)gy_py_engine_follow, METH_O,
     "follow(step or None) -> logits bytes: the follower's side of a leader's step"},
    {"follow_adopt", (PyCFunction)gy_py_engine_follow_adopt, METH_VARARGS,
     "follow_adopt(id, seqs): a request's KV sequences on the follower's ranks"},
    {"follow_seqs", (PyCFunction)gy_py_engine_follow_seqs, METH_VARARGS,
     "follow_seqs(id) -> sequences per rank"},
    {"follow_forget", (PyCFunction)gy_py_engine_follow_forget, METH_VARARGS,
     "follow_forget(id): the follower lets go of a request's sequences without freeing them"},
    {"detach_kv", (PyCFunction)gy_py_engine_detach_kv, METH_NOARGS,
     "detach_kv(): forget the requests' KV sequences without freeing them"},
    {"transition_begin", (PyCFunction)gy_py_engine_transition_begin, METH_VARARGS,
     "transition_begin(old_models, old_kvs, groups)"},
    {"transition_adopt", (PyCFunction)gy_py_engine_transition_adopt, METH_VARARGS,
     "transition_adopt(id, group, old_seqs)"},
    {"transition_set_boundary", (PyCFunction)gy_py_engine_transition_set_boundary, METH_VARARGS,
     "transition_set_boundary(layer)"},
    {"transition_seq", (PyCFunction)gy_py_engine_transition_seq, METH_VARARGS,
     "transition_seq(id, rank) -> (group, old seq)"},
    {"transition_table", (PyCFunction)gy_py_engine_transition_table, METH_NOARGS,
     "transition_table() -> [(id, new seqs per rank, (group, old seq) per rank)]"},
    {"transition_end", (PyCFunction)gy_py_engine_transition_end, METH_NOARGS, "transition_end()"},
    {"transition_abort", (PyCFunction)gy_py_engine_transition_abort, METH_NOARGS,
     "transition_abort(): drop the transition's stage, keeping its sequences"},
    {"attach_kv", (PyCFunction)gy_py_engine_attach_kv, METH_VARARGS,
     "attach_kv(id, seqs): the request's KV sequence per rank again (a rollback)"},
    {"transition_detach", (PyCFunction)gy_py_engine_transition_detach, METH_NOARGS,
     "transition_detach(): forget the groups' KV sequences without freeing them"},
    {"transition_boundary", (PyCFunction)gy_py_engine_transition_boundary, METH_NOARGS,
     "transition_boundary() -> layer, or -1"},
    {"request_ids", (PyCFunction)gy_py_engine_request_ids, METH_NOARGS, "request_ids() -> unfinished ids"},
    {"set_dirty", (PyCFunction)gy_py_engine_set_dirty, METH_VARARGS,
     "set_dirty(stage, rank, dirty): steps mark the KV slots they write (None stops)"},
    {"stage_pairs", (PyCFunction)gy_py_engine_stage_pairs, METH_VARARGS,
     "stage_pairs(src_stage, dst_stage, rank) -> [(src_seq, dst_seq)] of every request on both"},
    {"set_remote", (PyCFunction)gy_py_engine_set_remote, METH_VARARGS,
     "set_remote(id, stage, src_stage, first_layer, end_layer): remote attention (empty: ends)"},
    {"remote_stats", (PyCFunction)gy_py_engine_remote_stats, METH_NOARGS,
     "remote_stats() -> {'calls', 'token_layers'} of remote attention so far"},
    {"stage_seq", (PyCFunction)gy_py_engine_stage_seq, METH_VARARGS,
     "stage_seq(stage, rank, id) -> the request's KV sequence there, or -1"},
    {"replan", (PyCFunction)gy_py_engine_replan, METH_VARARGS,
     "replan(layers, models): new layer ranges and models over the same stages and caches"},
    {"export", (PyCFunction)gy_py_engine_export, METH_VARARGS, "export(id) -> dict"},
    {"adopt", (PyCFunction)gy_py_engine_adopt, METH_VARARGS,
     "adopt(id, tokens, prompt_len, params, info, seqs)"},
    {"take", (PyCFunction)gy_py_engine_take, METH_VARARGS,
     "take(src, id, seqs): moves a request from Engine src here, with its progress and KV"},
    {"add", (PyCFunction)gy_py_engine_add_request, METH_VARARGS,
     "add(id, prompt, params, arrival)"},
    {"step", (PyCFunction)gy_py_engine_step, METH_VARARGS,
     "step(now) -> (tokens, finished, batch_tokens, preempted, prompt)"},
    {"abort", (PyCFunction)gy_py_engine_abort, METH_VARARGS, "abort(id)"},
    {"release", (PyCFunction)gy_py_engine_release, METH_VARARGS, "release(id)"},
    {"info", (PyCFunction)gy_py_engine_info, METH_VARARGS, "info(id) -> dict"},
    {"stats", (PyCFunction)gy_py_engine_stats, METH_NOARGS, "stats() -> dict"},
    {"hold", (PyCFunction)gy_py_engine_hold, METH_VARARGS, "hold(held): admit nothing new while held"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot gy_py_engine_slots[] = {
    {Py_tp_new, gy_py_engine_new},
    {Py_tp_dealloc, gy_py_engine_dealloc},
    {Py_tp_methods, gy_py_engine_methods},
    {Py_tp_doc, "Engine(model, kv, max_batch_tokens, max_running, max_prefill_chunk=0, watermark_blocks=0)"},
    {0, NULL},
};

static PyType_Spec gy_py_engine_spec = {
    .name = "gyges._C.Engine",
    .basicsize = sizeof(GyEngineObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = gy_py_engine_slots,
};

int gy_py_engine_add(PyObject *module) {
    PyObject *type = PyType_FromModuleAndSpec(module, &gy_py_engine_spec, NULL);
    if (type == NULL) return -1;
    gy_py_engine_type = type; /* the module keeps it alive */
    int rc = PyModule_AddObjectRef(module, "Engine", type);
    Py_DECREF(type);
    return rc;
}
