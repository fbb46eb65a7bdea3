/* arena_cuda.c: the CUDA backend of the arena, on the driver's virtual memory management API.
 *
 *   reserve   cuMemAddressReserve(n_slots * page_size)     -> the arena's base (a device address)
 *   create    a handle from the pool (else cuMemCreate)    -> physical page p
 *   map       cuMemMap(base + slot * page_size) + cuMemSetAccess(read/write for the device)
 *   unmap     cuMemUnmap                                    (the slot faults again afterwards)
 *   release   the handle goes back to the pool (else cuMemRelease)
 *   copy      device-to-device memmove inside the range
 *   write     host-to-device copy into the range (how weights get in), read the way back
 *
 * The driver is never linked: libcuda.so.1 is opened at run time and every entry point is
 * resolved through cuGetProcAddress, so `import gyges` works on machines without a driver and
 * this backend answers GY_ERR_UNAVAILABLE with the reason (no libcuda.so.1, driver too old, no
 * device, no VMM support). cuda.h is included for its types only.
 *
 * The handle pool. cuMemCreate costs ~200 us, too much for the path that grows the KV cache
 * during a TP transformation, so up to config->pool_pages handles are created ahead of need:
 *   - init fills the pool synchronously (init is not on the serving path);
 *   - create pops a handle (O(1), no driver call); only an empty pool falls back to cuMemCreate;
 *   - release pushes the handle back while the pool has room, and cuMemRelease's it beyond;
 *   - when create leaves the pool below half its target, a refill thread owned by the arena is
 *     woken and tops it up with cuMemCreate outside the arena's lock, so neither the caller nor
 *     other arena operations wait for the driver.
 * The pool counts against the budget: its target is min(pool_pages, max_pages - pages in use),
 * so pages in use + pooled handles (+ the one being created) never exceed budget_bytes. The
 * budget is meant to be the worker's share of GPU memory; a pool outside it would make a budget
 * of "all free memory" fail inside cuMemCreate, and the arena's accounting disagree with what
 * the device reports. The price is that the last pages before the budget is exhausted are not
 * pooled, and it is a small one: those are also the pages a worker near its budget creates least.
 * Pooled handles are reused as they are: a page created on this backend is NOT cleared (the cpu
 * backend's pages read as zeros; here they hold whatever the previous owner wrote).
 *
 * Outside the budget: the CUDA context itself, and a staging buffer (GY_CUDA_STAGING_BYTES,
 * cuMemAlloc'd on first use) for overlapping copies whose source and destination are close. */
#include "arena_backend.h"
#include "../core/alloc.h"

#ifndef GY_WITH_CUDA

static gy_status gy_cuda_init_unavailable(const gy_arena_config *config, void **state,
                                          uintptr_t *base) {
    (void)config;
    (void)state;
    (void)base;
    return GY_FAIL(GY_ERR_UNAVAILABLE,
                   "the CUDA arena backend is not available: gyges was not built with CUDA "
                   "(nvcc was not found at build time, or GYGES_CUDA=0)");
}

/* Only init is ever called: arena.c stops when init fails. */
const gy_arena_backend_ops gy_arena_cuda_ops = {
    .name = "cuda",
    .init = gy_cuda_init_unavailable,
    .host_accessible = 0,
};

#else /* GY_WITH_CUDA */

#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The driver API version we ask cuGetProcAddress for; VMM and cuGetProcAddress_v2 exist since. */
#define GY_CUDA_MIN_DRIVER 12000
#define GY_CUDA_STAGING_BYTES ((size_t)16 << 20)
/* A direct chunked memmove needs bytes/distance copies; beyond this many use the staging buffer. */
#define GY_CUDA_MAX_DIRECT_CHUNKS 16

/* ---- the driver, resolved once per process ---- */

/* Field names avoid the cu* names, which cuda.h turns into macros (cuMemcpyDtoD -> _v2...). */
typedef struct gy_cu_driver {
    CUresult (*init)(unsigned int);
    CUresult (*get_error_string)(CUresult, const char **);
    CUresult (*device_get_count)(int *);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_get_attribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
    CUresult (*primary_ctx_release)(CUdevice);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*ctx_synchronize)(void);
    CUresult (*mem_get_allocation_granularity)(size_t *, const CUmemAllocationProp *,
                                               CUmemAllocationGranularity_flags);
    CUresult (*mem_address_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr,
                                    unsigned long long);
    CUresult (*mem_address_free)(CUdeviceptr, size_t);
    CUresult (*mem_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                           unsigned long long);
    CUresult (*mem_release)(CUmemGenericAllocationHandle);
    CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                        unsigned long long);
    CUresult (*mem_unmap)(CUdeviceptr, size_t);
    CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*memcpy_dtod)(CUdeviceptr, CUdeviceptr, size_t);
    CUresult (*memcpy_peer)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t);
    CUresult (*memcpy_htod)(CUdeviceptr, const void *, size_t);
    CUresult (*memcpy_dtoh)(void *, CUdeviceptr, size_t);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
} gy_cu_driver;

static gy_cu_driver gy_cu;
static pthread_once_t gy_cu_once = PTHREAD_ONCE_INIT;
static gy_status gy_cu_load_status = GY_ERR_UNAVAILABLE;
static char gy_cu_load_message[512];

typedef CUresult (*gy_cu_get_proc_fn)(const char *, void **, int, cuuint64_t,
                                      CUdriverProcAddressQueryResult *);
typedef CUresult (*gy_cu_version_fn)(int *);

static const char *gy_cu_error_string(CUresult r) {
    const char *s = NULL;
    if (gy_cu.get_error_string == NULL || gy_cu.get_error_string(r, &s) != CUDA_SUCCESS || !s)
        return "unknown CUDA driver error";
    return s;
}

/* CUresult -> GY_ERR_CUDA with the driver's words, the entry point, file and line. */
#define GY_CU_FAIL(r, what)                                                                        \
    gy_error_set(GY_ERR_CUDA, __FILE__, __LINE__, "%s failed: %s (CUresult %d)", (what),          \
                 gy_cu_error_string(r), (int)(r))
#define GY_CU_CHECK(what, call)                                                                    \
    do {                                                                                           \
        CUresult gy_cu_r_ = (call);                                                                \
        if (gy_cu_r_ != CUDA_SUCCESS) return GY_CU_FAIL(gy_cu_r_, what);                           \
    } while (0)

static void gy_cu_load_fail(const char *fmt, const char *detail) {
    gy_cu_load_status = GY_ERR_UNAVAILABLE;
    snprintf(gy_cu_load_message, sizeof gy_cu_load_message, fmt, detail ? detail : "");
}

static void gy_cu_load(void) {
    /* Never dlclose'd: the driver does not support being unloaded, and the statically linked
     * CUDA runtime of the kernels opens the same library. */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        gy_cu_load_fail("the CUDA arena backend is not available: no CUDA driver here "
                        "(dlopen libcuda.so.1: %s)", dlerror());
        return;
    }
    gy_cu_version_fn driver_version = (gy_cu_version_fn)dlsym(lib, "cuDriverGetVersion");
    gy_cu_get_proc_fn get_proc = (gy_cu_get_proc_fn)dlsym(lib, "cuGetProcAddress_v2");
    int version = 0;
    if (driver_version == NULL || driver_version(&version) != CUDA_SUCCESS) {
        gy_cu_load_fail("the CUDA arena backend is not available: libcuda.so.1 has no working "
                        "cuDriverGetVersion%s", "");
        return;
    }
    if (version < GY_CUDA_MIN_DRIVER || get_proc == NULL) {
        char detail[64];
        snprintf(detail, sizeof detail, "%d.%d", version / 1000, (version % 1000) / 10);
        gy_cu_load_fail("the CUDA arena backend is not available: the CUDA driver is too old "
                        "(it supports CUDA %s; gyges needs 12.0 or newer)", detail);
        return;
    }
    static const struct { const char *name; size_t offset; } symbols[] = {
#define GY_CU_SYMBOL(name, field) {name, offsetof(gy_cu_driver, field)}
        GY_CU_SYMBOL("cuInit", init),
        GY_CU_SYMBOL("cuGetErrorString", get_error_string),
        GY_CU_SYMBOL("cuDeviceGetCount", device_get_count),
        GY_CU_SYMBOL("cuDeviceGet", device_get),
        GY_CU_SYMBOL("cuDeviceGetAttribute", device_get_attribute),
        GY_CU_SYMBOL("cuDevicePrimaryCtxRetain", primary_ctx_retain),
        GY_CU_SYMBOL("cuDevicePrimaryCtxRelease", primary_ctx_release),
        GY_CU_SYMBOL("cuCtxSetCurrent", ctx_set_current),
        GY_CU_SYMBOL("cuCtxSynchronize", ctx_synchronize),
        GY_CU_SYMBOL("cuMemGetAllocationGranularity", mem_get_allocation_granularity),
        GY_CU_SYMBOL("cuMemAddressReserve", mem_address_reserve),
        GY_CU_SYMBOL("cuMemAddressFree", mem_address_free),
        GY_CU_SYMBOL("cuMemCreate", mem_create),
        GY_CU_SYMBOL("cuMemRelease", mem_release),
        GY_CU_SYMBOL("cuMemMap", mem_map),
        GY_CU_SYMBOL("cuMemUnmap", mem_unmap),
        GY_CU_SYMBOL("cuMemSetAccess", mem_set_access),
        GY_CU_SYMBOL("cuMemcpyDtoD", memcpy_dtod),
        GY_CU_SYMBOL("cuMemcpyPeer", memcpy_peer),
        GY_CU_SYMBOL("cuMemcpyHtoD", memcpy_htod),
        GY_CU_SYMBOL("cuMemcpyDtoH", memcpy_dtoh),
        GY_CU_SYMBOL("cuMemAlloc", mem_alloc),
        GY_CU_SYMBOL("cuMemFree", mem_free),
#undef GY_CU_SYMBOL
    };
    gy_cu_driver driver;
    memset(&driver, 0, sizeof driver);
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        void *fn = NULL;
        CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        /* Asking for the 12.0 ABI gives the size_t (_v2) variants of the old entry points. */
        if (get_proc(symbols[i].name, &fn, GY_CUDA_MIN_DRIVER, CU_GET_PROC_ADDRESS_DEFAULT,
                     &found) != CUDA_SUCCESS ||
            fn == NULL || found != CU_GET_PROC_ADDRESS_SUCCESS) {
            gy_cu_load_fail("the CUDA arena backend is not available: the CUDA driver does not "
                            "provide %s (driver too old?)", symbols[i].name);
            return;
        }
        memcpy((char *)&driver + symbols[i].offset, &fn, sizeof fn);
    }
    gy_cu = driver;
    CUresult r = gy_cu.init(0);
    if (r != CUDA_SUCCESS) {
        char detail[256];
        snprintf(detail, sizeof detail, "%s (CUresult %d)", gy_cu_error_string(r), (int)r);
        gy_cu_load_fail(r == CUDA_ERROR_NO_DEVICE
                            ? "the CUDA arena backend is not available: no CUDA device (cuInit: %s)"
                            : "the CUDA arena backend is not available: cuInit failed: %s",
                        detail);
        return;
    }
    gy_cu_load_status = GY_OK;
}

static gy_status gy_cu_require(void) {
    pthread_once(&gy_cu_once, gy_cu_load);
    if (gy_cu_load_status != GY_OK) return GY_FAIL(gy_cu_load_status, "%s", gy_cu_load_message);
    return GY_OK;
}

/* ---- one arena ---- */

typedef struct gy_cuda_arena {
    CUdevice device;
    CUcontext ctx;              /* the device's primary context, shared with the CUDA runtime */
    CUdeviceptr base;
    uint64_t page_size;
    uint64_t n_slots;
    uint64_t max_pages;
    CUmemAllocationProp prop;
    CUmemAccessDesc access;
    CUmemGenericAllocationHandle *handles; /* (max_pages) handle of each created page, or 0 */
    uint8_t *has_handle;                   /* (max_pages) 1 while handles[p] is valid */
    CUdeviceptr staging;                   /* GY_CUDA_STAGING_BYTES, allocated on first use */
    gy_arena_driver_times driver;          /* the calls on the caller's path (under the arena's
                                              lock, as every op but the pool thread's) */

    /* The pool; everything below is guarded by pool_lock (the refill thread does not hold the
     * arena's lock). */
    pthread_mutex_t pool_lock;
    pthread_cond_t refill_wake;  /* create -> refill thread: the pool is low */
    pthread_cond_t pool_filled;  /* refill thread -> create: a handle arrived or it gave up */
    CUmemGenericAllocationHandle *pool; /* (pool_cap) stack of ready handles */
    uint64_t pool_cap;           /* config->pool_pages, clamped to max_pages */
    uint64_t pool_count;
    uint64_t in_use;             /* pages created and not released */
    uint64_t in_flight;          /* handles the refill thread is creating right now */
    int refill_wanted;
    int refill_failed;           /* the last refill hit a driver error; retried on next wake */
    int stopping;
    int thread_started;
    pthread_t thread;
} gy_cuda_arena;

static uint64_t gy_pool_target(const gy_cuda_arena *c) {
    const uint64_t room = c->max_pages - c->in_use;
    return c->pool_cap < room ? c->pool_cap : room;
}

/* Pool lock held. Wakes the refill thread when the pool fell below half its target. */
static void gy_pool_maybe_refill(gy_cuda_arena *c) {
    if (!c->thread_started) return;
    if ((c->pool_count + c->in_flight) * 2 < gy_pool_target(c)) {
        c->refill_wanted = 1;
        pthread_cond_signal(&c->refill_wake);
    }
}

static void *gy_pool_refill_main(void *arg) {
    gy_cuda_arena *c = arg;
    gy_cu.ctx_set_current(c->ctx);
    pthread_mutex_lock(&c->pool_lock);
    for (;;) {
        while (!c->stopping && !c->refill_wanted) pthread_cond_wait(&c->refill_wake, &c->pool_lock);
        if (c->stopping) break;
        c->refill_wanted = 0;
        c->refill_failed = 0;
        while (!c->stopping && c->pool_count + c->in_flight < gy_pool_target(c)) {
            c->in_flight++;
            pthread_mutex_unlock(&c->pool_lock);
            CUmemGenericAllocationHandle h = 0;
            CUresult r = gy_cu.mem_create(&h, c->page_size, &c->prop, 0);
            pthread_mutex_lock(&c->pool_lock);
            c->in_flight--;
            if (r != CUDA_SUCCESS) {
                /* Creates fall back to cuMemCreate themselves and report the error there. */
                c->refill_failed = 1;
                pthread_cond_broadcast(&c->pool_filled);
                break;
            }
            if (c->pool_count < gy_pool_target(c)) {
                c->pool[c->pool_count++] = h;
            } else { /* pages were created meanwhile: the budget has no room for this one */
                pthread_mutex_unlock(&c->pool_lock);
                gy_cu.mem_release(h);
                pthread_mutex_lock(&c->pool_lock);
            }
            pthread_cond_broadcast(&c->pool_filled);
        }
    }
    pthread_mutex_unlock(&c->pool_lock);
    return NULL;
}

static void gy_cuda_teardown(gy_cuda_arena *c) {
    if (c == NULL) return;
    if (c->thread_started) {
        pthread_mutex_lock(&c->pool_lock);
        c->stopping = 1;
        pthread_cond_signal(&c->refill_wake);
        pthread_mutex_unlock(&c->pool_lock);
        pthread_join(c->thread, NULL);
    }
    if (c->ctx != NULL) gy_cu.ctx_set_current(c->ctx);
    /* arena.c has unmapped every slot and released every page before destroy, so this only
     * finds handles after an init that failed half-way, or a release the driver refused. */
    for (uint64_t p = 0; c->handles != NULL && p < c->max_pages; p++)
        if (c->has_handle[p]) gy_cu.mem_release(c->handles[p]);
    for (uint64_t i = 0; i < c->pool_count; i++) gy_cu.mem_release(c->pool[i]);
    if (c->staging != 0) gy_cu.mem_free(c->staging);
    if (c->base != 0) gy_cu.mem_address_free(c->base, c->n_slots * c->page_size);
    if (c->ctx != NULL) gy_cu.primary_ctx_release(c->device);
    pthread_cond_destroy(&c->refill_wake);
    pthread_cond_destroy(&c->pool_filled);
    pthread_mutex_destroy(&c->pool_lock);
    free(c->handles);
    free(c->has_handle);
    free(c->pool);
    free(c);
}

static gy_status gy_cuda_open_device(gy_cuda_arena *c, int32_t ordinal) {
    int count = 0;
    GY_CU_CHECK("cuDeviceGetCount", gy_cu.device_get_count(&count));
    if (count == 0)
        return GY_FAIL(GY_ERR_UNAVAILABLE,
                       "the CUDA arena backend is not available: no CUDA device");
    if (ordinal < 0 || ordinal >= count)
        return GY_FAIL(GY_ERR_INVALID, "CUDA device %d does not exist (this machine has %d)",
                       (int)ordinal, count);
    GY_CU_CHECK("cuDeviceGet", gy_cu.device_get(&c->device, ordinal));
    int vmm = 0;
    GY_CU_CHECK("cuDeviceGetAttribute",
                gy_cu.device_get_attribute(
                    &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, c->device));
    if (!vmm)
        return GY_FAIL(GY_ERR_UNAVAILABLE,
                       "CUDA device %d does not support virtual memory management (cuMemMap)",
                       (int)ordinal);
    GY_CU_CHECK("cuDevicePrimaryCtxRetain", gy_cu.primary_ctx_retain(&c->ctx, c->device));
    GY_CU_CHECK("cuCtxSetCurrent", gy_cu.ctx_set_current(c->ctx));
    return GY_OK;
}

static gy_status gy_cuda_setup(gy_cuda_arena *c, const gy_arena_config *config) {
    GY_TRY(gy_cuda_open_device(c, config->device));
    memset(&c->prop, 0, sizeof c->prop);
    c->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    c->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    c->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    c->prop.location.id = c->device;
    memset(&c->access, 0, sizeof c->access);
    c->access.location = c->prop.location;
    c->access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;

    size_t granularity = 0;
    GY_CU_CHECK("cuMemGetAllocationGranularity",
                gy_cu.mem_get_allocation_granularity(&granularity, &c->prop,
                                                     CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    if (granularity == 0 || c->page_size % granularity != 0)
        return GY_FAIL(GY_ERR_INVALID,
                       "page_size %llu is not a multiple of CUDA device %d's allocation "
                       "granularity %zu bytes",
                       (unsigned long long)c->page_size, (int)config->device, granularity);
    /* Aligning the reservation to a page keeps every slot aligned to the granularity. */
    GY_CU_CHECK("cuMemAddressReserve",
                gy_cu.mem_address_reserve(&c->base, c->n_slots * c->page_size, c->page_size, 0, 0));

    c->handles = gy_calloc(c->max_pages ? c->max_pages : 1, sizeof *c->handles);
    c->has_handle = gy_calloc(c->max_pages ? c->max_pages : 1, 1);
    c->pool_cap = config->pool_pages < c->max_pages ? config->pool_pages : c->max_pages;
    c->pool = gy_calloc(c->pool_cap ? c->pool_cap : 1, sizeof *c->pool);
    if (c->handles == NULL || c->has_handle == NULL || c->pool == NULL)
        return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the CUDA arena's handle tables");
    /* The first fill is synchronous: init is not on the serving path, and a budget the device
     * cannot hold is better refused now than in the middle of a transformation. */
    while (c->pool_count < c->pool_cap) {
        CUmemGenericAllocationHandle h = 0;
        GY_CU_CHECK("cuMemCreate", gy_cu.mem_create(&h, c->page_size, &c->prop, 0));
        c->pool[c->pool_count++] = h;
    }
    if (c->pool_cap > 0) {
        int err = pthread_create(&c->thread, NULL, gy_pool_refill_main, c);
        if (err != 0)
            return GY_FAIL(GY_ERR_SYSTEM, "cannot start the CUDA arena's pool thread: %s",
                           strerror(err));
        c->thread_started = 1;
    }
    return GY_OK;
}

static gy_status gy_cuda_init(const gy_arena_config *config, void **state, uintptr_t *base) {
    GY_TRY(gy_cu_require());
    gy_cuda_arena *c = gy_calloc(1, sizeof *c);
    if (c == NULL) return GY_FAIL(GY_ERR_SYSTEM, "out of host memory for the CUDA arena");
    pthread_mutex_init(&c->pool_lock, NULL);
    pthread_cond_init(&c->refill_wake, NULL);
    pthread_cond_init(&c->pool_filled, NULL);
    c->page_size = config->page_size;
    c->n_slots = config->n_slots;
    c->max_pages = config->budget_bytes / config->page_size;
    gy_status s = gy_cuda_setup(c, config);
    if (s != GY_OK) {
        gy_cuda_teardown(c); /* keeps the message: teardown only calls the driver */
        return s;
    }
    *state = c;
    *base = (uintptr_t)c->base;
    return GY_OK;
}

static void gy_cuda_destroy(void *state, uintptr_t base, const gy_arena_config *config) {
    (void)base;
    (void)config;
    gy_cuda_teardown(state);
}

/* Seconds of a monotonic clock, for timing one driver call. */
static double gy_cuda_clock(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Counts one driver call of kind `call` that began at `t0` (gy_cuda_clock). */
static void gy_cuda_count(gy_cuda_arena *c, gy_arena_driver_call call, double t0) {
    c->driver.seconds[call] += gy_cuda_clock() - t0;
    c->driver.calls[call]++;
}

static void gy_cuda_driver_times(const void *state, gy_arena_driver_times *out) {
    *out = ((const gy_cuda_arena *)state)->driver;
}

static gy_status gy_cuda_create(void *state, int64_t page) {
    gy_cuda_arena *c = state;
    CUmemGenericAllocationHandle h = 0;
    int have = 0;
    pthread_mutex_lock(&c->pool_lock);
    /* A handle being created will be ours sooner than a new cuMemCreate, and waiting for it
     * keeps the pool from overshooting the budget. */
    while (c->pool_count == 0 && c->in_flight > 0 && !c->refill_failed)
        pthread_cond_wait(&c->pool_filled, &c->pool_lock);
    if (c->pool_count > 0) {
        h = c->pool[--c->pool_count];
        have = 1;
    }
    c->in_use++;
    gy_pool_maybe_refill(c);
    pthread_mutex_unlock(&c->pool_lock);
    if (!have) {
        gy_cu.ctx_set_current(c->ctx);
        const double t0 = gy_cuda_clock();
        CUresult r = gy_cu.mem_create(&h, c->page_size, &c->prop, 0);
        gy_cuda_count(c, GY_ARENA_DRIVER_CREATE, t0);
        if (r != CUDA_SUCCESS) {
            pthread_mutex_lock(&c->pool_lock);
            c->in_use--;
            pthread_mutex_unlock(&c->pool_lock);
            return GY_CU_FAIL(r, "cuMemCreate");
        }
    }
    c->handles[page] = h;
    c->has_handle[page] = 1;
    return GY_OK;
}

static gy_status gy_cuda_release(void *state, int64_t page) {
    gy_cuda_arena *c = state;
    const CUmemGenericAllocationHandle h = c->handles[page];
    pthread_mutex_lock(&c->pool_lock);
    const int pooled = c->pool_count + c->in_flight < c->pool_cap;
    if (pooled) {
        c->pool[c->pool_count++] = h;
        c->in_use--;
        pthread_cond_broadcast(&c->pool_filled);
    }
    pthread_mutex_unlock(&c->pool_lock);
    if (!pooled) {
        /* On failure the page stays created, as arena.c expects of a refused call. */
        const double t0 = gy_cuda_clock();
        const CUresult r = gy_cu.mem_release(h);
        gy_cuda_count(c, GY_ARENA_DRIVER_RELEASE, t0);
        if (r != CUDA_SUCCESS) return GY_CU_FAIL(r, "cuMemRelease");
        pthread_mutex_lock(&c->pool_lock);
        c->in_use--;
        pthread_mutex_unlock(&c->pool_lock);
    }
    c->handles[page] = 0;
    c->has_handle[page] = 0;
    return GY_OK;
}

static gy_status gy_cuda_map(void *state, int64_t slot, int64_t page) {
    gy_cuda_arena *c = state;
    const CUdeviceptr at = c->base + (CUdeviceptr)slot * c->page_size;
    double t0 = gy_cuda_clock();
    CUresult r = gy_cu.mem_map(at, c->page_size, 0, c->handles[page], 0);
    gy_cuda_count(c, GY_ARENA_DRIVER_MAP, t0);
    if (r != CUDA_SUCCESS) return GY_CU_FAIL(r, "cuMemMap");
    t0 = gy_cuda_clock();
    r = gy_cu.mem_set_access(at, c->page_size, &c->access, 1);
    gy_cuda_count(c, GY_ARENA_DRIVER_SET_ACCESS, t0);
    if (r != CUDA_SUCCESS) {
        gy_cu.mem_unmap(at, c->page_size); /* leave the slot as it was */
        return GY_CU_FAIL(r, "cuMemSetAccess");
    }
    return GY_OK;
}

static gy_status gy_cuda_unmap(void *state, int64_t slot) {
    gy_cuda_arena *c = state;
    const CUdeviceptr at = c->base + (CUdeviceptr)slot * c->page_size;
    const double t0 = gy_cuda_clock();
    const CUresult r = gy_cu.mem_unmap(at, c->page_size);
    gy_cuda_count(c, GY_ARENA_DRIVER_UNMAP, t0);
    if (r != CUDA_SUCCESS) return GY_CU_FAIL(r, "cuMemUnmap");
    return GY_OK;
}

/* memmove for device memory. cuMemcpy's result is undefined when the ranges overlap, so an
 * overlapping move goes chunk by chunk in the safe direction (front to back when moving down,
 * back to front when moving up): either directly, in chunks of the distance between the ranges
 * (a chunk then never overlaps itself, and never overwrites source bytes still to be read), or
 * through the staging buffer when the distance is small and direct chunks would be many. */
static gy_status gy_cuda_copy(void *state, uint64_t dst_offset, uint64_t src_offset,
                              uint64_t bytes) {
    gy_cuda_arena *c = state;
    if (bytes == 0 || dst_offset == src_offset) return GY_OK;
    GY_CU_CHECK("cuCtxSetCurrent", gy_cu.ctx_set_current(c->ctx));
    /* Like the cpu backend's memmove: see every write issued before, finish before returning. */
    GY_CU_CHECK("cuCtxSynchronize", gy_cu.ctx_synchronize());
    const CUdeviceptr dst = c->base + dst_offset, src = c->base + src_offset;
    const uint64_t distance = dst > src ? dst - src : src - dst;
    const int up = dst > src;
    if (distance >= bytes) {
        GY_CU_CHECK("cuMemcpyDtoD", gy_cu.memcpy_dtod(dst, src, bytes));
    } else if ((bytes + distance - 1) / distance <= GY_CUDA_MAX_DIRECT_CHUNKS) {
        for (uint64_t done = 0; done < bytes;) {
            const uint64_t n = bytes - done < distance ? bytes - done : distance;
            const uint64_t at = up ? bytes - done - n : done;
            GY_CU_CHECK("cuMemcpyDtoD", gy_cu.memcpy_dtod(dst + at, src + at, n));
            done += n;
        }
    } else {
        if (c->staging == 0)
            GY_CU_CHECK("cuMemAlloc", gy_cu.mem_alloc(&c->staging, GY_CUDA_STAGING_BYTES));
        for (uint64_t done = 0; done < bytes;) {
            const uint64_t left = bytes - done;
            const uint64_t n = left < GY_CUDA_STAGING_BYTES ? left : GY_CUDA_STAGING_BYTES;
            const uint64_t at = up ? left - n : done;
            GY_CU_CHECK("cuMemcpyDtoD", gy_cu.memcpy_dtod(c->staging, src + at, n));
            GY_CU_CHECK("cuMemcpyDtoD", gy_cu.memcpy_dtod(dst + at, c->staging, n));
            done += n;
        }
    }
    GY_CU_CHECK("cuCtxSynchronize", gy_cu.ctx_synchronize());
    return GY_OK;
}

/* Runs from another arena: on the same device (virtual workers sharing a GPU: one context, so
 * one device-to-device copy reaches both ranges), or on another device (a pipeline stage's
 * weights moving between GPUs in a re-split) by cuMemcpyPeer between the two primary contexts,
 * which goes over NVLink/PCIe peer access where there is one and is staged by the driver where
 * there is not. Synchronised like `copy`: before, in both contexts, so that the workers'
 * streams have written what is read; after, so the caller may free or reuse either side.
 * Runs inside one arena may overlap and go through gy_cuda_copy's memmove. */
static gy_status gy_cuda_copy_runs_from(void *dst_state, void *src_state,
                                        const uint64_t *dst_offsets, const uint64_t *src_offsets,
                                        const uint64_t *bytes, int64_t n) {
    gy_cuda_arena *d = dst_state, *s = src_state;
    if (d->device != s->device) {
        GY_CU_CHECK("cuCtxSetCurrent", gy_cu.ctx_set_current(s->ctx));
        GY_CU_CHECK("cuCtxSynchronize", gy_cu.ctx_synchronize());
        GY_CU_CHECK("cuCtxSetCurrent", gy_cu.ctx_set_current(d->ctx));
        GY_CU_CHECK("cuCtxSynchronize", gy_cu.ctx_synchronize());
        for (int64_t i = 0; i < n; i++)
            if (bytes[i] > 0)
                GY_CU_CHECK("cuMemcpyPeer",
                            gy_cu.memcpy_peer(d->base + dst_offsets[i], d->ctx,
                                              s->base + src_offsets[i], s->ctx, bytes[i]));
        GY_CU_CHECK("cuCtxSynchronize", gy_cu.ctx_synchronize());
        return GY_OK;
    }
    if (d == s) {
        for (int64_t i = 0; i < n; i++) GY_TRY(gy_cuda_copy(d, dst_offsets[i], src_offsets[i], bytes[i]));
        return GY_OK;
    }
    GY_CU_CHECK("cuCtxSetCurrent", gy_cu.ctx_set_current(d->ctx));
    GY_CU_CHECK("cuCtxSynchronize", gy_cu.ctx_synchronize());
    for (int64_t i = 0; i < n; i++)
        if (bytes[i] > 0)
            GY_CU_CHECK("cuMemcpyDtoD", gy_cu.memcpy_dtod(d->base + dst_offsets[i],
                                                          s->base + src_offsets[i], bytes[i]));
    GY_CU_CHECK("cuCtxSynchronize", gy_cu.ctx_synchronize());
    return GY_OK;
}

/* Host <-> device. The context is synchronised on both sides: before, so that work issued on
 * other streams (a forward pass writing KV) is complete; after, because a copy from pageable
 * memory may return before its DMA lands, and kernels on non-blocking streams would not wait
 * for it. Neither is on a serving path (weights are written once, reads are for inspection). */
static gy_status gy_cuda_write(void *state, uint64_t offset, const void *src, uint64_t bytes) {
    gy_cuda_arena *c = state;
    GY_CU_CHECK("cuCtxSetCurrent", gy_cu.ctx_set_current(c->ctx));
    GY_CU_CHECK("cuCtxSynchronize", gy_cu.ctx_synchronize());
    GY_CU_CHECK("cuMemcpyHtoD", gy_cu.memcpy_htod(c->base + offset, src, bytes));
    GY_CU_CHECK("cuCtxSynchronize", gy_cu.ctx_synchronize());
    return GY_OK;
}

static gy_status gy_cuda_read(void *state, void *dst, uint64_t offset, uint64_t bytes) {
    gy_cuda_arena *c = state;
    GY_CU_CHECK("cuCtxSetCurrent", gy_cu.ctx_set_current(c->ctx));
    GY_CU_CHECK("cuCtxSynchronize", gy_cu.ctx_synchronize());
    GY_CU_CHECK("cuMemcpyDtoH", gy_cu.memcpy_dtoh(dst, c->base + offset, bytes));
    return GY_OK;
}

const gy_arena_backend_ops gy_arena_cuda_ops = {
    .name = "cuda",
    .init = gy_cuda_init,
    .destroy = gy_cuda_destroy,
    .create = gy_cuda_create,
    .release = gy_cuda_release,
    .map = gy_cuda_map,
    .unmap = gy_cuda_unmap,
    .copy = gy_cuda_copy,
    .write = gy_cuda_write,
    .read = gy_cuda_read,
    .copy_runs_from = gy_cuda_copy_runs_from,
    .driver_times = gy_cuda_driver_times,
    .host_accessible = 0,
};

#endif /* GY_WITH_CUDA */
