/* emu_device.c: the rest of the emulated device of emu.c: the device calls of kernels.h (devices,
 * memory, the KV copies, residual add, argmax) and the device side of the communicators
 * (kernels/comm_d2d.h), so that comm_d2d.c and comm_stream.c, compiled unchanged with
 * GY_WITH_CUDA, join virtual workers here as they do on a GPU.
 *
 * Everything runs synchronously on the calling thread, like emu.c's kernels: a stream is a token,
 * an event is a no-op, a copy is a memmove when it is enqueued. That is enough for the d2d
 * protocol (comm_stream.c): between its two host barriers every rank's inputs are complete,
 * because every rank finished its own work before it reached the first one. What the emulation
 * cannot show, work overtaking other work on another stream, is what tests/fake_cuda/ checks.
 * One thing it does check: a rank's collectives run on the stream of the kernels before them
 * (emu_stream_mismatches counts the calls that did not), which is what keeps an all-reduce in
 * order on a real GPU.
 *
 * GYGES_EMU_DEVICES (default 1) sets how many devices there are; "Device memory" is host memory
 * (malloc), counted in emu_live_allocs. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/dtype.h"
#include "kernels/comm_d2d.h"
#include "kernels/kernels.h"

extern long emu_live_allocs;
long emu_stream_mismatches;
static _Thread_local gy_cuda_stream emu_kernel_stream; /* of this thread's last kernel */
static _Thread_local int32_t emu_current_device;

void emu_kernel_on(gy_cuda_stream stream) { emu_kernel_stream = stream; }

/* A collective's work on `stream` after kernels on another one: on a GPU nothing would order it
 * after them. */
static void emu_collective_on(gy_cuda_stream stream) {
    if (emu_kernel_stream != NULL && stream != emu_kernel_stream)
        __atomic_fetch_add(&emu_stream_mismatches, 1, __ATOMIC_RELAXED);
}

static int32_t emu_device_count(void) {
    const char *env = getenv("GYGES_EMU_DEVICES");
    return env ? atoi(env) : 1;
}

static void *emu_alloc(uint64_t bytes) {
    void *p = malloc(bytes ? (size_t)bytes : 1);
    if (p != NULL) __atomic_fetch_add(&emu_live_allocs, 1, __ATOMIC_RELAXED);
    return p;
}

static void emu_release(void *p) {
    if (p == NULL) return;
    free(p);
    __atomic_fetch_sub(&emu_live_allocs, 1, __ATOMIC_RELAXED);
}

/* ---- kernels.h: devices and memory ---- */

gy_status gy_cuda_device_count(int32_t *count) {
    *count = emu_device_count();
    if (*count <= 0) {
        *count = 0;
        return GY_FAIL(GY_ERR_UNAVAILABLE, "CUDA is not available: no CUDA device (emulated)");
    }
    return GY_OK;
}

gy_status gy_cuda_device_info_get(gy_cuda_device_info *out, int32_t device) {
    memset(out, 0, sizeof *out);
    if (device < 0 || device >= emu_device_count())
        return GY_FAIL(GY_ERR_INVALID, "CUDA device %d does not exist (emulated)", (int)device);
    snprintf(out->name, sizeof out->name, "emulated device %d", (int)device);
    out->major = 9;
    out->multiprocessors = 1;
    out->total_bytes = out->free_bytes = (uint64_t)1 << 34;
    return GY_OK;
}

gy_status gy_cuda_set_device(int32_t device) {
    if (device < 0 || device >= emu_device_count())
        return GY_FAIL(GY_ERR_INVALID, "CUDA device %d does not exist (emulated)", (int)device);
    emu_current_device = device;
    return GY_OK;
}

gy_status gy_cuda_malloc(void **ptr, uint64_t bytes) {
    *ptr = emu_alloc(bytes);
    return *ptr ? GY_OK : GY_FAIL(GY_ERR_CUDA, "cudaMalloc failed (emulated): out of memory");
}

void gy_cuda_free(void *ptr) { emu_release(ptr); }

gy_status gy_cuda_memcpy_htod(void *dst, const void *src_host, uint64_t bytes) {
    if (bytes) memmove(dst, src_host, (size_t)bytes);
    return GY_OK;
}

gy_status gy_cuda_memcpy_dtoh(void *dst_host, const void *src, uint64_t bytes) {
    if (bytes) memmove(dst_host, src, (size_t)bytes);
    return GY_OK;
}

gy_status gy_cuda_memset(void *dst, int value, uint64_t bytes) {
    if (bytes) memset(dst, value, (size_t)bytes);
    return GY_OK;
}

gy_status gy_cuda_stream_synchronize(gy_cuda_stream stream) {
    (void)stream;
    return GY_OK;
}

/* ---- kernels.h: KV movement (byte copies through gy_kv_layout_offset, as the kernels do) ---- */

static gy_status emu_check_layout(const gy_kv_layout *l, const char *what) {
    if (l == NULL || l->block_size <= 0 || l->n_heads <= 0 || l->head_dim <= 0 ||
        l->elem_size <= 0 || l->n_blocks < 0)
        return GY_FAIL(GY_ERR_INVALID, "%s: bad layout (emulated)", what);
    return GY_OK;
}

static void emu_row(void *dst, const void *src, const gy_kv_layout *l) {
    memmove(dst, src, (size_t)(l->head_dim * l->elem_size));
}

gy_status gy_cuda_kv_scatter(void *storage, const gy_kv_layout *layout, const void *k,
                             const void *v, const int32_t *block_table, int64_t start,
                             int64_t n_tokens, gy_cuda_stream stream) {
    GY_TRY(emu_check_layout(layout, "kv_scatter"));
    emu_kernel_on(stream);
    const int64_t es = layout->elem_size, row = layout->head_dim * es;
    for (int64_t t = 0; t < n_tokens; t++) {
        const int64_t p = start + t, b = block_table[p / layout->block_size];
        if (b < 0 || b >= layout->n_blocks) continue;
        for (int64_t h = 0; h < layout->n_heads; h++) {
            const int64_t at = (t * layout->n_heads + h) * row;
            emu_row((char *)storage + gy_kv_layout_offset(layout, 0, b, p % layout->block_size, h) * es,
                    (const char *)k + at, layout);
            emu_row((char *)storage + gy_kv_layout_offset(layout, 1, b, p % layout->block_size, h) * es,
                    (const char *)v + at, layout);
        }
    }
    return GY_OK;
}

gy_status gy_cuda_kv_gather(void *k, void *v, const void *storage, const gy_kv_layout *layout,
                            const int32_t *block_table, int64_t start, int64_t n_tokens,
                            gy_cuda_stream stream) {
    GY_TRY(emu_check_layout(layout, "kv_gather"));
    emu_kernel_on(stream);
    const int64_t es = layout->elem_size, row = layout->head_dim * es;
    for (int64_t t = 0; t < n_tokens; t++) {
        const int64_t p = start + t, b = block_table[p / layout->block_size];
        for (int64_t h = 0; h < layout->n_heads; h++) {
            const int64_t at = (t * layout->n_heads + h) * row;
            if (b < 0 || b >= layout->n_blocks) {
                memset((char *)k + at, 0, (size_t)row);
                memset((char *)v + at, 0, (size_t)row);
                continue;
            }
            emu_row((char *)k + at,
                    (const char *)storage + gy_kv_layout_offset(layout, 0, b, p % layout->block_size, h) * es,
                    layout);
            emu_row((char *)v + at,
                    (const char *)storage + gy_kv_layout_offset(layout, 1, b, p % layout->block_size, h) * es,
                    layout);
        }
    }
    return GY_OK;
}

gy_status gy_cuda_kv_copy_heads(void *dst, const gy_kv_layout *dst_layout,
                                const int32_t *dst_blocks, int64_t dst_head0, const void *src,
                                const gy_kv_layout *src_layout, const int32_t *src_blocks,
                                int64_t src_head0, int64_t n_heads, int64_t n_blocks,
                                gy_cuda_stream stream) {
    GY_TRY(emu_check_layout(dst_layout, "kv_copy_heads (destination)"));
    GY_TRY(emu_check_layout(src_layout, "kv_copy_heads (source)"));
    if (dst_layout->block_size != src_layout->block_size ||
        dst_layout->head_dim != src_layout->head_dim ||
        dst_layout->elem_size != src_layout->elem_size || n_heads < 0 || n_blocks < 0 ||
        src_head0 < 0 || src_head0 + n_heads > src_layout->n_heads || dst_head0 < 0 ||
        dst_head0 + n_heads > dst_layout->n_heads)
        return GY_FAIL(GY_ERR_INVALID, "kv_copy_heads: bad arguments (emulated)");
    emu_kernel_on(stream);
    const int64_t es = src_layout->elem_size;
    for (int64_t i = 0; i < n_blocks; i++) {
        const int64_t sb = src_blocks[i], db = dst_blocks[i];
        if (sb < 0 || sb >= src_layout->n_blocks || db < 0 || db >= dst_layout->n_blocks) continue;
        for (int64_t kv = 0; kv < 2; kv++)
            for (int64_t t = 0; t < src_layout->block_size; t++)
                for (int64_t h = 0; h < n_heads; h++)
                    emu_row((char *)dst + gy_kv_layout_offset(dst_layout, kv, db, t, dst_head0 + h) * es,
                            (const char *)src + gy_kv_layout_offset(src_layout, kv, sb, t, src_head0 + h) * es,
                            src_layout);
    }
    return GY_OK;
}

/* ---- kernels.h: the two model kernels emu.c does not have ---- */

static float emu_ld(const void *p, gy_dtype t, int64_t i) {
    if (t == GY_DTYPE_F32) return ((const float *)p)[i];
    if (t == GY_DTYPE_BF16) return gy_bf16_to_f32(((const uint16_t *)p)[i]);
    return gy_f16_to_f32(((const uint16_t *)p)[i]);
}

gy_status gy_cuda_residual_add(void *out, const void *a, const void *b, int64_t n, gy_dtype dtype,
                               gy_cuda_stream stream) {
    emu_kernel_on(stream);
    for (int64_t i = 0; i < n; i++) {
        const float s = emu_ld(a, dtype, i) + emu_ld(b, dtype, i);
        if (dtype == GY_DTYPE_F32) ((float *)out)[i] = s;
        else if (dtype == GY_DTYPE_BF16) ((uint16_t *)out)[i] = gy_f32_to_bf16(s);
        else ((uint16_t *)out)[i] = gy_f32_to_f16(s);
    }
    return GY_OK;
}

gy_status gy_cuda_argmax(int32_t *out, const void *logits, int64_t rows, int64_t vocab,
                         gy_dtype dtype, gy_cuda_stream stream) {
    emu_kernel_on(stream);
    for (int64_t r = 0; r < rows; r++) {
        int64_t best = 0;
        for (int64_t j = 1; j < vocab; j++)
            if (emu_ld(logits, dtype, r * vocab + j) > emu_ld(logits, dtype, r * vocab + best)) best = j;
        out[r] = (int32_t)best;
    }
    return GY_OK;
}

/* ---- comm_d2d.h: synchronous streams, events and copies ---- */

gy_status gy_cuda_comm_device_swap(int32_t device, int32_t *previous) {
    if (previous) *previous = emu_current_device;
    if (device < 0 || device >= emu_device_count())
        return GY_FAIL(GY_ERR_CUDA, "cudaSetDevice(%d) failed: invalid device ordinal (emulated)",
                       (int)device);
    emu_current_device = device;
    return GY_OK;
}

gy_status gy_cuda_comm_device_count(int32_t *count) { return gy_cuda_device_count(count); }

/* A stream token remembers its priority (greatest -1, least 0, as on a GPU). */
gy_status gy_cuda_comm_stream_create(gy_cuda_stream *out, int32_t lowest) {
    int32_t *token = emu_alloc(sizeof(int32_t));
    if (token == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of memory (emulated stream)");
    *token = lowest ? 0 : -1;
    *out = (gy_cuda_stream)token;
    return GY_OK;
}

void gy_cuda_comm_stream_destroy(gy_cuda_stream stream) { emu_release(stream); }

gy_status gy_cuda_comm_stream_priority(gy_cuda_stream stream, int32_t *priority) {
    /* Streams the emulated runtime made (cudaStreamCreateWithFlags) are a default priority. */
    *priority = 0;
    (void)stream;
    return GY_OK;
}

gy_status gy_cuda_comm_stream_synchronize(gy_cuda_stream stream) {
    (void)stream;
    return GY_OK;
}

gy_status gy_cuda_comm_event_create(gy_cuda_event *out) {
    *out = (gy_cuda_event)emu_alloc(1);
    return *out ? GY_OK : GY_FAIL(GY_ERR_SYSTEM, "out of memory (emulated event)");
}

void gy_cuda_comm_event_destroy(gy_cuda_event event) { emu_release(event); }

gy_status gy_cuda_comm_event_record(gy_cuda_event event, gy_cuda_stream stream) {
    (void)event;
    (void)stream;
    return GY_OK;
}

gy_status gy_cuda_comm_stream_wait(gy_cuda_stream stream, gy_cuda_event event) {
    (void)stream;
    (void)event;
    return GY_OK;
}

gy_status gy_cuda_comm_malloc(void **out, uint64_t bytes) { return gy_cuda_malloc(out, bytes); }

void gy_cuda_comm_free(void *ptr) { emu_release(ptr); }

gy_status gy_cuda_comm_copy(void *dst, const void *src, uint64_t bytes, gy_cuda_stream stream) {
    if (bytes == 0 || dst == src) return GY_OK;
    if (dst == NULL || src == NULL) return GY_FAIL(GY_ERR_INVALID, "comm_copy: NULL dst or src");
    emu_collective_on(stream);
    memmove(dst, src, (size_t)bytes);
    return GY_OK;
}

gy_status gy_cuda_comm_copy_h2d(void *dst, const void *src_host, uint64_t bytes,
                                gy_cuda_stream stream) {
    if (bytes) memmove(dst, src_host, (size_t)bytes);
    (void)stream;
    return GY_OK;
}

gy_status gy_cuda_comm_copy_d2h(void *dst_host, const void *src, uint64_t bytes,
                                gy_cuda_stream stream) {
    if (bytes) memmove(dst_host, src, (size_t)bytes);
    (void)stream;
    return GY_OK;
}

gy_status gy_cuda_comm_sum_tree(float *out, const float *const *in, int32_t n_in, int64_t n,
                                gy_cuda_stream stream) {
    if (n < 0 || n_in < 1 || n_in > GY_CUDA_COMM_MAX_INPUTS || (n_in & (n_in - 1)))
        return GY_FAIL(GY_ERR_INVALID, "comm_sum_tree: bad n=%lld or n_in=%d", (long long)n, (int)n_in);
    emu_collective_on(stream);
    for (int64_t i = 0; i < n; i++) {
        float v[GY_CUDA_COMM_MAX_INPUTS];
        for (int32_t r = 0; r < n_in; r++) v[r] = in[r][i];
        for (int32_t w = n_in; w > 1; w /= 2)
            for (int32_t j = 0; j < w / 2; j++) v[j] = v[2 * j] + v[2 * j + 1];
        out[i] = v[0];
    }
    return GY_OK;
}

/* ---- kernels.h entry points that only py_cuda.c's kernel tests and benchmarks bind: those tests
 * run the real kernels (tests/kernel_emu/), so here they are refused, never emulated. ---- */
#define EMU_NOT_HERE(what)                                                                          \
    GY_FAIL(GY_ERR_UNAVAILABLE, "%s is not part of the emulated device (tests/kernel_emu runs the " \
            "real kernel on the host)", what)
gy_status gy_cuda_kv_write_check(const gy_kv_layout *layout, gy_dtype kv_dtype, gy_dtype act_dtype,
                                 int64_t n_tokens, int64_t n_seqs) {
    (void)layout, (void)kv_dtype, (void)act_dtype, (void)n_tokens, (void)n_seqs;
    return EMU_NOT_HERE("gy_cuda_kv_write_check");
}
gy_status gy_cuda_paged_attention_check(gy_dtype act_dtype, const gy_kv_layout *layout,
                                        gy_dtype kv_dtype, int64_t n_tokens, int64_t n_seqs,
                                        int64_t n_q_heads, int64_t max_len, float scale) {
    (void)act_dtype, (void)layout, (void)kv_dtype, (void)n_tokens, (void)n_seqs, (void)n_q_heads;
    (void)max_len, (void)scale;
    return EMU_NOT_HERE("gy_cuda_paged_attention_check");
}
gy_status gy_cuda_sample_check(gy_dtype dtype, int64_t rows, int64_t vocab) {
    (void)dtype, (void)rows, (void)vocab;
    return EMU_NOT_HERE("gy_cuda_sample_check");
}
int64_t gy_cuda_sample_workspace_bytes(int64_t rows, int64_t vocab) { return rows * vocab * 8; }
gy_status gy_cuda_sample(int32_t *tokens, const void *logits, gy_dtype dtype, int64_t rows,
                         int64_t vocab, const gy_sampler_params *params, const int64_t *token_index,
                         void *workspace, int64_t workspace_bytes, gy_cuda_stream stream) {
    (void)tokens, (void)logits, (void)dtype, (void)rows, (void)vocab, (void)params;
    (void)token_index, (void)workspace, (void)workspace_bytes, (void)stream;
    return EMU_NOT_HERE("gy_cuda_sample");
}
gy_status gy_cuda_memcpy_dtod(void *dst, const void *src, uint64_t bytes, gy_cuda_stream stream) {
    (void)dst, (void)src, (void)bytes, (void)stream;
    return EMU_NOT_HERE("gy_cuda_memcpy_dtod");
}
gy_status gy_cuda_event_create(gy_cuda_event *out) {
    (void)out;
    return EMU_NOT_HERE("gy_cuda_event_create");
}
void gy_cuda_event_destroy(gy_cuda_event event) { (void)event; }
gy_status gy_cuda_event_record(gy_cuda_event event, gy_cuda_stream stream) {
    (void)event, (void)stream;
    return EMU_NOT_HERE("gy_cuda_event_record");
}
gy_status gy_cuda_event_elapsed_ms(float *ms, gy_cuda_event start, gy_cuda_event end) {
    (void)ms, (void)start, (void)end;
    return EMU_NOT_HERE("gy_cuda_event_elapsed_ms");
}
