/* comm_d2d.cu: the device side of the communicators (comm_d2d.h): the fp32 tree sum of
 * the d2d all-reduce, device-to-device copies, and the stream, event and memory calls the d2d
 * and nccl backends make, so that csrc/comm/ needs no CUDA header. */
#include "comm_d2d.h"

#include "common.cuh"

/* ---- the tree sum ---- */

struct gy_comm_sum_inputs {
    const float *p[GY_CUDA_COMM_MAX_INPUTS];
};

/* out: (n)   in.p[r]: (n), r < N. N is a template argument so that v[] lives in registers. The
 * loop is core/tree.h's, element by element: v[j] = v[2j] + v[2j+1], an odd last one carried up,
 * until one is left. */
template <int N>
__global__ void gy_comm_sum_tree_kernel(float *out, gy_comm_sum_inputs in, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float v[N];
#pragma unroll
        for (int r = 0; r < N; r++) v[r] = in.p[r][i];
#pragma unroll
        for (int w = N; w > 1; w = (w + 1) / 2) {
#pragma unroll
            for (int j = 0; j < w / 2; j++) v[j] = __fadd_rn(v[2 * j], v[2 * j + 1]);
            if (w & 1) v[w / 2] = v[w - 1];
        }
        out[i] = v[0];
    }
}

template <int N>
static gy_status gy_comm_sum_tree_launch(float *out, const gy_comm_sum_inputs &in, int64_t n,
                                         cudaStream_t stream) {
    gy_comm_sum_tree_kernel<N><<<gy_cuda_blocks(n, GY_CUDA_THREADS), GY_CUDA_THREADS, 0, stream>>>(
        out, in, n);
    GY_CUDA_CHECK_LAUNCH("gy_comm_sum_tree_kernel");
    return GY_OK;
}

extern "C" gy_status gy_cuda_comm_sum_tree(float *out, const float *const *in, int32_t n_in,
                                           int64_t n, gy_cuda_stream stream) {
    if (n < 0) return GY_FAIL(GY_ERR_INVALID, "comm_sum_tree: n=%lld must be >= 0", (long long)n);
    if (n_in < 1 || n_in > GY_CUDA_COMM_MAX_INPUTS)
        return GY_FAIL(GY_ERR_INVALID, "comm_sum_tree: %d inputs (1 to %d expected)", (int)n_in,
                       GY_CUDA_COMM_MAX_INPUTS);
    if (n == 0) return GY_OK;
    if (out == NULL || in == NULL) return GY_FAIL(GY_ERR_INVALID, "comm_sum_tree: NULL out or in");
    gy_comm_sum_inputs inputs = {};
    for (int32_t r = 0; r < n_in; r++) {
        if (in[r] == NULL) return GY_FAIL(GY_ERR_INVALID, "comm_sum_tree: input %d is NULL", (int)r);
        inputs.p[r] = in[r];
    }
    switch (n_in) {
    case 1: return gy_cuda_comm_copy(out, in[0], (uint64_t)n * sizeof(float), stream);
    case 2: return gy_comm_sum_tree_launch<2>(out, inputs, n, stream);
    case 3: return gy_comm_sum_tree_launch<3>(out, inputs, n, stream);
    case 4: return gy_comm_sum_tree_launch<4>(out, inputs, n, stream);
    case 5: return gy_comm_sum_tree_launch<5>(out, inputs, n, stream);
    case 6: return gy_comm_sum_tree_launch<6>(out, inputs, n, stream);
    case 7: return gy_comm_sum_tree_launch<7>(out, inputs, n, stream);
    case 8: return gy_comm_sum_tree_launch<8>(out, inputs, n, stream);
    case 9: return gy_comm_sum_tree_launch<9>(out, inputs, n, stream);
    case 10: return gy_comm_sum_tree_launch<10>(out, inputs, n, stream);
    case 11: return gy_comm_sum_tree_launch<11>(out, inputs, n, stream);
    case 12: return gy_comm_sum_tree_launch<12>(out, inputs, n, stream);
    case 13: return gy_comm_sum_tree_launch<13>(out, inputs, n, stream);
    case 14: return gy_comm_sum_tree_launch<14>(out, inputs, n, stream);
    case 15: return gy_comm_sum_tree_launch<15>(out, inputs, n, stream);
    default: return gy_comm_sum_tree_launch<16>(out, inputs, n, stream);
    }
}

/* ---- copies ---- */

extern "C" gy_status gy_cuda_comm_copy(void *dst, const void *src, uint64_t bytes,
                                       gy_cuda_stream stream) {
    if (bytes == 0 || dst == src) return GY_OK;
    if (dst == NULL || src == NULL) return GY_FAIL(GY_ERR_INVALID, "comm_copy: NULL dst or src");
    GY_CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyDeviceToDevice, stream));
    return GY_OK;
}

extern "C" gy_status gy_cuda_comm_copy_h2d(void *dst, const void *src_host, uint64_t bytes,
                                           gy_cuda_stream stream) {
    if (bytes == 0) return GY_OK;
    if (dst == NULL || src_host == NULL) return GY_FAIL(GY_ERR_INVALID, "comm_copy_h2d: NULL");
    GY_CUDA_CHECK(cudaMemcpyAsync(dst, src_host, (size_t)bytes, cudaMemcpyHostToDevice, stream));
    return GY_OK;
}

extern "C" gy_status gy_cuda_comm_copy_d2h(void *dst_host, const void *src, uint64_t bytes,
                                           gy_cuda_stream stream) {
    if (bytes == 0) return GY_OK;
    if (dst_host == NULL || src == NULL) return GY_FAIL(GY_ERR_INVALID, "comm_copy_d2h: NULL");
    GY_CUDA_CHECK(cudaMemcpyAsync(dst_host, src, (size_t)bytes, cudaMemcpyDeviceToHost, stream));
    return GY_OK;
}

/* ---- devices, streams, events, memory ---- */

extern "C" gy_status gy_cuda_comm_device_count(int32_t *count) {
    *count = 0;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* not sticky: leave no error behind for the next launch check */
        return gy_cuda_status(e, "cudaGetDeviceCount", __FILE__, __LINE__);
    }
    if (n == 0) return GY_FAIL(GY_ERR_UNAVAILABLE, "CUDA is not available: no CUDA device");
    *count = (int32_t)n;
    return GY_OK;
}

extern "C" gy_status gy_cuda_comm_device_swap(int32_t device, int32_t *previous) {
    int current = 0;
    GY_CUDA_CHECK(cudaGetDevice(&current));
    if (previous != NULL) *previous = (int32_t)current;
    if (current != device) GY_CUDA_CHECK(cudaSetDevice(device));
    return GY_OK;
}

extern "C" gy_status gy_cuda_comm_stream_create(gy_cuda_stream *out, int32_t lowest) {
    *out = NULL;
    int least = 0, greatest = 0;
    GY_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t stream = NULL;
    GY_CUDA_CHECK(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking,
                                               lowest ? least : greatest));
    *out = stream;
    return GY_OK;
}

extern "C" void gy_cuda_comm_stream_destroy(gy_cuda_stream stream) {
    if (stream == NULL) return;
    if (cudaStreamSynchronize(stream) != cudaSuccess) cudaGetLastError();
    if (cudaStreamDestroy(stream) != cudaSuccess) cudaGetLastError();
}

extern "C" gy_status gy_cuda_comm_stream_priority(gy_cuda_stream stream, int32_t *priority) {
    int p = 0;
    GY_CUDA_CHECK(cudaStreamGetPriority(stream, &p));
    *priority = (int32_t)p;
    return GY_OK;
}

extern "C" gy_status gy_cuda_comm_stream_synchronize(gy_cuda_stream stream) {
    GY_CUDA_CHECK(cudaStreamSynchronize(stream));
    return GY_OK;
}

extern "C" gy_status gy_cuda_comm_event_create(gy_cuda_event *out) {
    *out = NULL;
    cudaEvent_t event = NULL;
    GY_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    *out = event;
    return GY_OK;
}

extern "C" void gy_cuda_comm_event_destroy(gy_cuda_event event) {
    if (event != NULL && cudaEventDestroy(event) != cudaSuccess) cudaGetLastError();
}

extern "C" gy_status gy_cuda_comm_event_record(gy_cuda_event event, gy_cuda_stream stream) {
    GY_CUDA_CHECK(cudaEventRecord(event, stream));
    return GY_OK;
}

extern "C" gy_status gy_cuda_comm_stream_wait(gy_cuda_stream stream, gy_cuda_event event) {
    GY_CUDA_CHECK(cudaStreamWaitEvent(stream, event, 0));
    return GY_OK;
}

extern "C" gy_status gy_cuda_comm_malloc(void **out, uint64_t bytes) {
    *out = NULL;
    GY_CUDA_CHECK(cudaMalloc(out, bytes ? (size_t)bytes : 1));
    return GY_OK;
}

extern "C" void gy_cuda_comm_free(void *ptr) {
    if (ptr != NULL && cudaFree(ptr) != cudaSuccess) cudaGetLastError();
}
