/* forward_backend.h (private to the engine): a forward backend, the three parts of the pass of
 * forward.h on one kind of worker, as ggml's backends in small. forward.c checks what every
 * backend shares (the TP group, cache and batch; the layers held; the embedding and head) and
 * then calls the model's backend; the backends never call each other or forward.c.
 *
 *   forward_cpu.c   host memory, the CPU kernels, fp32 activations
 *   forward_cuda.c  device memory on the worker's stream (forward_cuda.h says how it differs)
 *
 * A backend left out of the build has NULL parts and says why (`unavailable`). */
#ifndef GY_ENGINE_FORWARD_BACKEND_H
#define GY_ENGINE_FORWARD_BACKEND_H

#include "forward.h"

typedef struct gy_forward_backend {
    const char *name;
    /* After gy_forward_check passed; max_len is the largest position of the batch + 1. */
    gy_status (*begin)(const gy_model *model, const gy_tp_group *tp, gy_kv_cache *kv,
                       const gy_forward_batch *batch, gy_forward_ws *ws, int embed,
                       int64_t max_len);
    /* After gy_forward_check_layers passed. */
    gy_status (*layers)(const gy_model *model, const gy_tp_group *tp, gy_kv_cache *kv,
                        const gy_forward_batch *batch, gy_forward_ws *ws, gy_threadpool *pool,
                        int64_t first_layer, int64_t end_layer);
    /* logits: host memory [n_logits, vocab], not NULL when n_logits > 0. */
    gy_status (*end)(float *logits, const gy_model *model, const gy_forward_batch *batch,
                     gy_forward_ws *ws, gy_threadpool *pool);
    /* The hidden states a pipeline stage hands to the next, through host memory: `host` holds
     * rows of row_bytes (>= hidden * the activation size; the activations' own bytes, so no
     * rounding happens on the way). x_in fills ws's x [n, hidden] with host row map[i] (row i
     * when map is NULL) before the layers; x_out writes ws's x back the same way after them,
     * and returns once the bytes are in host memory. */
    gy_status (*x_in)(const gy_model *model, gy_forward_ws *ws, const void *host, size_t row_bytes,
                      const int32_t *map, int64_t n);
    gy_status (*x_out)(const gy_model *model, gy_forward_ws *ws, void *host, size_t row_bytes,
                       const int32_t *map, int64_t n);
    /* Frees the backend's part of a workspace (a workspace may hold both). */
    void (*ws_free)(gy_forward_ws *ws);
    const char *(*unavailable)(void);
} gy_forward_backend;

/* The paged batch of remote part p's rows in p's cache (forward.h: gy_forward_remote). */
gy_cpu_paged_batch gy_forward_remote_paged(const gy_forward_batch *b, const gy_forward_remote *p);

extern const gy_forward_backend gy_forward_cpu_backend;
extern const gy_forward_backend gy_forward_cuda_backend;

#endif
