/* forward_cuda.h: the forward pass of forward.h on a CUDA worker (gy_forward_cuda_backend of
 * forward_backend.h), called through forward.h's begin / layers / end when model->backend is
 * GY_MODEL_BACKEND_CUDA; this header has what else a CUDA worker needs.
 *
 * What differs from the CPU pass, and why:
 *   - the weights, the KV cache and every activation are device memory; the weight pointers are
 *     device addresses in a CUDA arena, and the KV cache lives in the same arena;
 *   - activations are in the weight dtype (cuBLAS multiplies matrices of one dtype), computed in
 *     fp32 and rounded once per kernel; the o_proj and FFN partial sums are fp32 (the GEMMs write
 *     them as fp32, the FFN shards accumulate onto one another in fp32, and the all-reduce adds
 *     fp32), and the residual stream takes them back in the activation dtype;
 *   - the KV cache holds the activation dtype when its elem_size is 2, fp32 when it is 4;
 *   - a step uploads its index arrays with one host-to-device copy of a packed buffer, and `end`
 *     copies the logits back to the host (the engine samples there, with the same sampler as the
 *     CPU backend) and waits for the stream, so that nothing is in flight between steps;
 *   - tensor parallelism needs an all-reduce over device buffers on the worker's stream
 *     (tp->device_buffers); the shared-memory communicator is refused.
 *
 * Memory outside the arena's budget: the workspace (activations of the largest batch seen, the
 * attention kernels' scratch, the logits of the sampled rows) and cuBLAS's own workspace, like the
 * CUDA context itself. The weights and KV pages are the arena's, counted to the byte.
 *
 * The pass is compiled in when gyges is built with CUDA and the kernels it needs are declared in
 * csrc/kernels/kernels.h; otherwise every entry point answers GY_ERR_UNAVAILABLE with the reason
 * (gy_forward_cuda_unavailable). */
#ifndef GY_ENGINE_FORWARD_CUDA_H
#define GY_ENGINE_FORWARD_CUDA_H

#include <stdint.h>

#include "forward.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Puts `model` (whose weight pointers are device addresses) on CUDA device `device`: records the
 * backend and device and creates the worker's stream (non-blocking, so several workers on one GPU
 * overlap). Also checks that cuBLAS can be loaded, so a missing library is reported here. */
gy_status gy_forward_cuda_attach(gy_model *model, int32_t device);
/* Waits for the model's stream and destroys it. Free every workspace that used the model first.
 * A no-op for a cpu model. */
void gy_forward_cuda_detach(gy_model *model);

/* The device workspace of a gy_forward_ws (its `cuda` member); NULL is a no-op. */
void gy_forward_cuda_ws_free(struct gy_forward_cuda_ws *cws);

/* Why the CUDA forward pass is not in this build, or NULL when it is. */
const char *gy_forward_cuda_unavailable(void);

#ifdef __cplusplus
}
#endif
#endif
