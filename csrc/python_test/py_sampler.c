/* py_sampler.c: the CPU sampler (csrc/sched/sampler.h) and its random numbers (core/rng.h) on
 * NumPy buffers, for the tests that check the draws against their definition and the CUDA sampler
 * against the CPU one; the engine samples from C. */
#include "py_test.h"

#include "core/rng.h"
#include "sched/logits.h"
#include "sched/sampler.h"

/* Borrows a C-contiguous buffer of float32 (code 'f') or float64 ('d') values, exactly `count`
 * of them unless count < 0. */
static int gy_py_get_floats(PyObject *object, Py_buffer *view, Py_ssize_t count, const char *what,
                             int writable, char code) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(GY_PY_VALUE_ERROR, "%s must be a %sC-contiguous buffer", what,
                     writable ? "writable " : "");
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    if (f[0] != code || f[1] != '\0' || view->itemsize != (code == 'f' ? 4 : 8)) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s must hold %s values, got format '%s'", what,
                     code == 'f' ? "float32" : "float64", view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    if (count >= 0 && view->len != count * view->itemsize) {
        PyErr_Format(GY_PY_VALUE_ERROR, "%s has %zd values, expected %zd", what,
                     view->len / view->itemsize, count);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

int gy_py_sampler_rows(PyObject *rows_object, long long rows, int64_t vocab,
                       gy_sampler_params **params_out, int64_t **index_out) {
    *params_out = NULL;
    *index_out = NULL;
    PyObject *seq = gy_py_sequence(rows_object, "params must be a sequence of tuples");
    if (seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != rows) {
        PyErr_Format(GY_PY_VALUE_ERROR, "params has %zd rows, expected %lld",
                     PySequence_Fast_GET_SIZE(seq), rows);
        Py_DECREF(seq);
        return -1;
    }
    gy_sampler_params *params = PyMem_Calloc((size_t)(rows > 0 ? rows : 1), sizeof *params);
    int64_t *index = PyMem_Calloc((size_t)(rows > 0 ? rows : 1), sizeof *index);
    int ok = params != NULL && index != NULL;
    if (!ok) PyErr_NoMemory();
    for (long long r = 0; ok && r < rows; r++) {
        unsigned long long seed;
        long long top_k, token_index;
        ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, r), "dLdKL|d;params rows are "
                              "(temperature, top_k, top_p, seed, token_index[, min_p])",
                              &params[r].temperature, &top_k, &params[r].top_p, &seed,
                              &token_index, &params[r].min_p);
        if (!ok) break;
        params[r].top_k = top_k;
        params[r].seed = seed;
        index[r] = token_index;
        gy_status s;
        if (vocab > 0 && (s = gy_sampler_check(&params[r], vocab)) != GY_OK) {
            gy_py_raise(GY_FAIL(s, "row %lld: %s", r, gy_error_message()));
            ok = 0;
        }
    }
    Py_DECREF(seq);
    if (!ok) {
        PyMem_Free(params);
        PyMem_Free(index);
        return -1;
    }
    *params_out = params;
    *index_out = index;
    return 0;
}

/* sample(logits, n, vocab, params) -> list of n tokens. logits: float32 (n, vocab) buffer;
 * params: n tuples (temperature, top_k, top_p, seed, token_index[, min_p]). */
static PyObject *gy_py_sample(PyObject *module, PyObject *args) {
    PyObject *logits_object, *params_object;
    long long n, vocab;
    if (!PyArg_ParseTuple(args, "OLLO", &logits_object, &n, &vocab, &params_object)) return NULL;
    if (n < 0 || vocab < 1 || vocab > INT32_MAX || (n > 0 && vocab > PY_SSIZE_T_MAX / 8 / n))
        return PyErr_Format(GY_PY_VALUE_ERROR, "bad shape (%lld, %lld)", n, vocab);
    gy_sampler_params *params;
    int64_t *index;
    /* the C sampler checks each row itself (vocab 0: no check here) */
    if (gy_py_sampler_rows(params_object, n, 0, &params, &index) < 0) return NULL;
    PyObject *result = NULL;
    Py_buffer logits = {0};
    int have_logits = 0;
    int32_t *tokens = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *tokens);
    if (tokens == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (gy_py_get_floats(logits_object, &logits, (Py_ssize_t)(n * vocab), "logits", 0, 'f') < 0)
        goto done;
    have_logits = 1;
    gy_status st;
    Py_BEGIN_ALLOW_THREADS
    st = gy_sampler_sample_batch(tokens, logits.buf, n, vocab, params, index);
    Py_END_ALLOW_THREADS
    if (st != GY_OK) {
        gy_py_raise(st);
        goto done;
    }
    result = PyList_New((Py_ssize_t)n);
    if (result == NULL) goto done;
    for (long long r = 0; r < n; r++) {
        PyObject *t = PyLong_FromLong(tokens[r]);
        if (t == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, (Py_ssize_t)r, t);
    }
done:
    if (have_logits) PyBuffer_Release(&logits);
    PyMem_Free(params);
    PyMem_Free(index);
    PyMem_Free(tokens);
    return result;
}

/* sampler_probs(logits, temperature, top_k, top_p, out[, min_p]): out (vocab) float64 receives
 * the distribution the draw uses; vocab is the length of logits (float32). */
static PyObject *gy_py_sampler_probs(PyObject *module, PyObject *args) {
    PyObject *logits_object, *out_object;
    gy_sampler_params p = {0};
    long long top_k;
    if (!PyArg_ParseTuple(args, "OdLdO|d", &logits_object, &p.temperature, &top_k, &p.top_p,
                          &out_object, &p.min_p))
        return NULL;
    p.top_k = top_k;
    Py_buffer logits, out;
    if (gy_py_get_floats(logits_object, &logits, -1, "logits", 0, 'f') < 0) return NULL;
    const Py_ssize_t vocab = logits.len / 4;
    if (gy_py_get_floats(out_object, &out, vocab, "out", 1, 'd') < 0) {
        PyBuffer_Release(&logits);
        return NULL;
    }
    gy_status st;
    Py_BEGIN_ALLOW_THREADS
    st = gy_sampler_probs(out.buf, logits.buf, (int64_t)vocab, &p);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&logits);
    PyBuffer_Release(&out);
    if (st != GY_OK) return gy_py_raise(st);
    Py_RETURN_NONE;
}

/* logits_process(logits_f32, tokens_i32, prompt_len, repetition, frequency, presence,
 *                min_tokens, stop_i32): penalises the row in place (sched/logits.h). */
static PyObject *gy_py_logits_process(PyObject *module, PyObject *args) {
    PyObject *logits_object, *tokens_object, *stop_object;
    long long prompt_len, min_tokens;
    gy_sampler_params p = {0};
    if (!PyArg_ParseTuple(args, "OOLdddLO", &logits_object, &tokens_object, &prompt_len,
                          &p.repetition_penalty, &p.frequency_penalty, &p.presence_penalty,
                          &min_tokens, &stop_object))
        return NULL;
    Py_buffer logits, tokens, stop;
    if (gy_py_get_floats(logits_object, &logits, -1, "logits", 1, 'f') < 0) return NULL;
    if (PyObject_GetBuffer(tokens_object, &tokens, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&logits);
        return NULL;
    }
    if (PyObject_GetBuffer(stop_object, &stop, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&logits);
        PyBuffer_Release(&tokens);
        return NULL;
    }
    const int64_t vocab = logits.len / 4;
    int32_t *counts = PyMem_Calloc((size_t)vocab, sizeof *counts);
    gy_status st = GY_OK;
    if (counts != NULL)
        st = gy_logits_process(logits.buf, vocab, tokens.buf, tokens.len / 4, prompt_len, &p,
                               min_tokens, stop.buf, stop.len / 4, counts);
    PyMem_Free(counts);
    PyBuffer_Release(&logits);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&stop);
    if (counts == NULL) return PyErr_NoMemory();
    if (st != GY_OK) return gy_py_raise(st);
    Py_RETURN_NONE;
}

/* logits_logprobs(logits_f32, token, k) -> (logprob, rank, [(token, logprob)] * k) */
static PyObject *gy_py_logits_logprobs(PyObject *module, PyObject *args) {
    PyObject *logits_object;
    int token, k;
    if (!PyArg_ParseTuple(args, "Oii", &logits_object, &token, &k)) return NULL;
    Py_buffer logits;
    if (gy_py_get_floats(logits_object, &logits, -1, "logits", 0, 'f') < 0) return NULL;
    gy_logprobs lp;
    const gy_status st = gy_logits_logprobs(&lp, logits.buf, logits.len / 4, token, k);
    PyBuffer_Release(&logits);
    if (st != GY_OK) return gy_py_raise(st);
    PyObject *top = PyList_New(lp.n_top);
    for (int32_t j = 0; top != NULL && j < lp.n_top; j++) {
        PyObject *pair = Py_BuildValue("(id)", (int)lp.top_tokens[j], lp.top_logprobs[j]);
        if (pair == NULL) Py_CLEAR(top);
        else PyList_SET_ITEM(top, j, pair);
    }
    if (top == NULL) return NULL;
    return Py_BuildValue("(dLN)", lp.logprob, (long long)lp.rank, top);
}

/* rng_uniform(seed, index, stream=the sampler's) -> float in [0, 1). */
static PyObject *gy_py_rng_uniform(PyObject *module, PyObject *args) {
    unsigned long long seed;
    long long index;
    unsigned int stream = GY_RNG_STREAM_SAMPLE;
    if (!PyArg_ParseTuple(args, "KL|I", &seed, &index, &stream)) return NULL;
    return PyFloat_FromDouble(gy_rng_uniform(seed, index, stream));
}

static PyMethodDef gy_py_sampler_functions[] = {
    {"sample", gy_py_sample, METH_VARARGS,
     "sample(logits, n, vocab, [(temperature, top_k, top_p, seed, token_index[, min_p])] * n) "
     "-> tokens"},
    {"sampler_probs", gy_py_sampler_probs, METH_VARARGS,
     "sampler_probs(logits_f32, temperature, top_k, top_p, out_f64[, min_p]): the draw's "
     "distribution"},
    {"logits_process", gy_py_logits_process, METH_VARARGS,
     "logits_process(logits_f32, tokens_i32, prompt_len, repetition_penalty, frequency_penalty, "
     "presence_penalty, min_tokens, stop_i32): penalises the row in place"},
    {"logits_logprobs", gy_py_logits_logprobs, METH_VARARGS,
     "logits_logprobs(logits_f32, token, k) -> (logprob, rank, [(token, logprob)] * k)"},
    {"rng_uniform", gy_py_rng_uniform, METH_VARARGS,
     "rng_uniform(seed, index, stream=sampler's) -> float in [0, 1)"},
    {NULL, NULL, 0, NULL},
};

int gy_py_sampler_add(PyObject *module) {
    if (PyModule_AddFunctions(module, gy_py_sampler_functions) < 0) return -1;
    return PyModule_AddIntConstant(module, "RNG_STREAM_SAMPLE", (long)GY_RNG_STREAM_SAMPLE);
}
