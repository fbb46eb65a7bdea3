/* libcuda.c: a pretend libcuda.so.1 for the emulated builds of the extension
 * (build.py ext and kernels): the driver entry points csrc/mem/arena_cuda.c resolves through
 * cuGetProcAddress, so that arena_cuda.c itself (reservation, handle pool and its refill thread,
 * map/unmap, copies inside an arena and between arenas, host copies in and out) runs on a machine
 * without a GPU, under the Python tests of tests/test_cuda_host.py.
 *
 * Virtual memory management on host memory, the way arena_cpu.c does it: cuMemAddressReserve is
 * a PROT_NONE reservation; a handle (cuMemCreate) is a range of one sparse memfd shared by every
 * handle, so hundreds of pages cost one file descriptor; cuMemMap maps that range over the
 * reservation (still inaccessible) and cuMemSetAccess opens it, as the real driver wants both;
 * cuMemUnmap puts PROT_NONE back, so a stray access faults. A released handle's range is punched
 * out of the file and reused. Copies are memmove; every call is synchronous, so cuCtxSynchronize
 * has nothing to wait for. GYGES_EMU_DEVICES (default 1) is the number of devices, each with memory
 * of its own: a handle belongs to the device its cuMemCreate names (a device that does not exist
 * is refused), cuMemSetAccess must name existing devices, and fake_cuda_device_bytes(device)
 * answers how much of a device's memory is held, so tests can see where workers' pages went. */
#define _GNU_SOURCE
#include <cuda.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define FAKE_GRANULARITY ((size_t)2 << 20)
#define FAKE_MAX_RESERVATIONS 4096

static pthread_mutex_t fake_lock = PTHREAD_MUTEX_INITIALIZER;
static int fake_fd = -1;
static size_t fake_file_end;   /* bytes of the memfd handed out so far */
typedef struct fake_range { size_t offset, size; int device; struct fake_range *next; } fake_range;
#define FAKE_MAX_DEVICES 16
static size_t fake_held[FAKE_MAX_DEVICES]; /* bytes of live handles, per device */
static fake_range *fake_free;  /* released handles' ranges, reused by size */
static struct { void *raw; size_t raw_size; CUdeviceptr base; } fake_reserved[FAKE_MAX_RESERVATIONS];

static int fake_devices(void) {
    const char *env = getenv("GYGES_EMU_DEVICES");
    const int n = env ? atoi(env) : 1;
    return n < 0 ? 0 : n > FAKE_MAX_DEVICES ? FAKE_MAX_DEVICES : n;
}

static int fake_device_exists(int device) { return device >= 0 && device < fake_devices(); }

/* Bytes of `device`'s memory held by live handles (cuMemCreate, not yet released). */
size_t fake_cuda_device_bytes(int device) {
    if (device < 0 || device >= FAKE_MAX_DEVICES) return 0;
    pthread_mutex_lock(&fake_lock);
    const size_t n = fake_held[device];
    pthread_mutex_unlock(&fake_lock);
    return n;
}

static CUresult fake_init(unsigned int flags) {
    (void)flags;
    return fake_devices() > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

static CUresult fake_get_error_string(CUresult r, const char **out) {
    switch (r) {
    case CUDA_SUCCESS: *out = "no error"; break;
    case CUDA_ERROR_NO_DEVICE: *out = "no CUDA-capable device is detected (emulated driver)"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *out = "out of memory (emulated driver)"; break;
    case CUDA_ERROR_INVALID_VALUE: *out = "invalid argument (emulated driver)"; break;
    case CUDA_ERROR_INVALID_DEVICE: *out = "invalid device ordinal (emulated driver)"; break;
    default: *out = "unknown error (emulated driver)"; break;
    }
    return CUDA_SUCCESS;
}

static CUresult fake_device_get_count(int *count) {
    *count = fake_devices();
    return CUDA_SUCCESS;
}

static CUresult fake_device_get(CUdevice *device, int ordinal) {
    if (ordinal < 0 || ordinal >= fake_devices()) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

static CUresult fake_device_get_attribute(int *value, CUdevice_attribute attribute, CUdevice device) {
    (void)device;
    *value = attribute == CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
    return CUDA_SUCCESS;
}

static CUresult fake_primary_ctx_retain(CUcontext *ctx, CUdevice device) {
    *ctx = (CUcontext)(uintptr_t)(0x1000 + device); /* a token; nothing dereferences it */
    return CUDA_SUCCESS;
}

static CUresult fake_primary_ctx_release(CUdevice device) {
    (void)device;
    return CUDA_SUCCESS;
}

static CUresult fake_ctx_set_current(CUcontext ctx) {
    (void)ctx;
    return CUDA_SUCCESS;
}

static CUresult fake_ctx_synchronize(void) { return CUDA_SUCCESS; }

static CUresult fake_granularity(size_t *out, const CUmemAllocationProp *prop,
                                 CUmemAllocationGranularity_flags option) {
    (void)prop;
    (void)option;
    *out = FAKE_GRANULARITY;
    return CUDA_SUCCESS;
}

static CUresult fake_address_reserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                     CUdeviceptr addr, unsigned long long flags) {
    (void)addr;
    (void)flags;
    if (alignment < FAKE_GRANULARITY) alignment = FAKE_GRANULARITY;
    const size_t raw_size = size + alignment;
    void *raw = mmap(NULL, raw_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    const CUdeviceptr base = ((CUdeviceptr)(uintptr_t)raw + alignment - 1) & ~(CUdeviceptr)(alignment - 1);
    pthread_mutex_lock(&fake_lock);
    int slot = -1;
    for (int i = 0; i < FAKE_MAX_RESERVATIONS && slot < 0; i++)
        if (fake_reserved[i].raw == NULL) slot = i;
    if (slot >= 0) {
        fake_reserved[slot].raw = raw;
        fake_reserved[slot].raw_size = raw_size;
        fake_reserved[slot].base = base;
    }
    pthread_mutex_unlock(&fake_lock);
    if (slot < 0) {
        munmap(raw, raw_size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = base;
    return CUDA_SUCCESS;
}

static CUresult fake_address_free(CUdeviceptr ptr, size_t size) {
    (void)size;
    pthread_mutex_lock(&fake_lock);
    for (int i = 0; i < FAKE_MAX_RESERVATIONS; i++)
        if (fake_reserved[i].raw != NULL && fake_reserved[i].base == ptr) {
            munmap(fake_reserved[i].raw, fake_reserved[i].raw_size);
            fake_reserved[i].raw = NULL;
            pthread_mutex_unlock(&fake_lock);
            return CUDA_SUCCESS;
        }
    pthread_mutex_unlock(&fake_lock);
    return CUDA_ERROR_INVALID_VALUE;
}

static CUresult fake_mem_create(CUmemGenericAllocationHandle *handle, size_t size,
                                const CUmemAllocationProp *prop, unsigned long long flags) {
    (void)flags;
    if (size == 0 || size % FAKE_GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
    if (prop == NULL || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!fake_device_exists(prop->location.id)) return CUDA_ERROR_INVALID_DEVICE;
    fake_range *r = NULL;
    pthread_mutex_lock(&fake_lock);
    if (fake_fd < 0) fake_fd = memfd_create("gyges_fake_device", MFD_CLOEXEC);
    for (fake_range **p = &fake_free; *p != NULL; p = &(*p)->next)
        if ((*p)->size == size) {
            r = *p;
            *p = r->next;
            break;
        }
    if (r == NULL && fake_fd >= 0 && (r = calloc(1, sizeof *r)) != NULL) {
        r->offset = fake_file_end;
        r->size = size;
        if (ftruncate(fake_fd, (off_t)(fake_file_end + size)) != 0) {
            free(r);
            r = NULL;
        } else {
            fake_file_end += size;
        }
    }
    if (r != NULL) {
        r->device = prop->location.id;
        fake_held[r->device] += size;
    }
    pthread_mutex_unlock(&fake_lock);
    if (r == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)r;
    return CUDA_SUCCESS;
}

static CUresult fake_mem_release(CUmemGenericAllocationHandle handle) {
    fake_range *r = (fake_range *)(uintptr_t)handle;
    /* Pages come back to the system, and a reused handle reads as zeros again. */
    fallocate(fake_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)r->offset, (off_t)r->size);
    pthread_mutex_lock(&fake_lock);
    fake_held[r->device] -= r->size;
    r->next = fake_free;
    fake_free = r;
    pthread_mutex_unlock(&fake_lock);
    return CUDA_SUCCESS;
}

static CUresult fake_mem_map(CUdeviceptr ptr, size_t size, size_t offset,
                             CUmemGenericAllocationHandle handle, unsigned long long flags) {
    (void)flags;
    const fake_range *r = (const fake_range *)(uintptr_t)handle;
    if (offset + size > r->size) return CUDA_ERROR_INVALID_VALUE;
    void *at = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, fake_fd,
                    (off_t)(r->offset + offset));
    return at == MAP_FAILED ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
}

static CUresult fake_mem_unmap(CUdeviceptr ptr, size_t size) {
    void *at = mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return at == MAP_FAILED ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

static CUresult fake_mem_set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                    size_t count) {
    if (count == 0 || desc == NULL) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < count; i++)
        if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
            !fake_device_exists(desc[i].location.id))
            return CUDA_ERROR_INVALID_DEVICE;
    return mprotect((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) == 0 ? CUDA_SUCCESS
                                                                              : CUDA_ERROR_INVALID_VALUE;
}

static CUresult fake_memcpy_dtod(CUdeviceptr dst, CUdeviceptr src, size_t bytes) {
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes);
    return CUDA_SUCCESS;
}

/* Between two devices' memory (arena_cuda.c's copies between arenas on different GPUs): the
 * contexts must be two existing devices' primary contexts, as the driver checks them. */
static CUresult fake_memcpy_peer(CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src,
                                 CUcontext src_ctx, size_t bytes) {
    const int dst_device = (int)((uintptr_t)dst_ctx - 0x1000);
    const int src_device = (int)((uintptr_t)src_ctx - 0x1000);
    if (!fake_device_exists(dst_device) || !fake_device_exists(src_device))
        return CUDA_ERROR_INVALID_CONTEXT;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes);
    return CUDA_SUCCESS;
}

static CUresult fake_memcpy_htod(CUdeviceptr dst, const void *src, size_t bytes) {
    memmove((void *)(uintptr_t)dst, src, bytes);
    return CUDA_SUCCESS;
}

static CUresult fake_memcpy_dtoh(void *dst, CUdeviceptr src, size_t bytes) {
    memmove(dst, (const void *)(uintptr_t)src, bytes);
    return CUDA_SUCCESS;
}

static CUresult fake_mem_alloc(CUdeviceptr *ptr, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (p == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

static CUresult fake_mem_free(CUdeviceptr ptr) {
    free((void *)(uintptr_t)ptr);
    return CUDA_SUCCESS;
}

/* ---- the two entry points arena_cuda.c looks up by name ---- */

CUresult CUDAAPI cuDriverGetVersion(int *version) {
    *version = 12080;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cuda_version,
                                  cuuint64_t flags, CUdriverProcAddressQueryResult *status) {
    (void)cuda_version;
    (void)flags;
    static const struct { const char *name; void *fn; } table[] = {
        {"cuInit", (void *)fake_init},
        {"cuGetErrorString", (void *)fake_get_error_string},
        {"cuDeviceGetCount", (void *)fake_device_get_count},
        {"cuDeviceGet", (void *)fake_device_get},
        {"cuDeviceGetAttribute", (void *)fake_device_get_attribute},
        {"cuDevicePrimaryCtxRetain", (void *)fake_primary_ctx_retain},
        {"cuDevicePrimaryCtxRelease", (void *)fake_primary_ctx_release},
        {"cuCtxSetCurrent", (void *)fake_ctx_set_current},
        {"cuCtxSynchronize", (void *)fake_ctx_synchronize},
        {"cuMemGetAllocationGranularity", (void *)fake_granularity},
        {"cuMemAddressReserve", (void *)fake_address_reserve},
        {"cuMemAddressFree", (void *)fake_address_free},
        {"cuMemCreate", (void *)fake_mem_create},
        {"cuMemRelease", (void *)fake_mem_release},
        {"cuMemMap", (void *)fake_mem_map},
        {"cuMemUnmap", (void *)fake_mem_unmap},
        {"cuMemSetAccess", (void *)fake_mem_set_access},
        {"cuMemcpyDtoD", (void *)fake_memcpy_dtod},
        {"cuMemcpyPeer", (void *)fake_memcpy_peer},
        {"cuMemcpyHtoD", (void *)fake_memcpy_htod},
        {"cuMemcpyDtoH", (void *)fake_memcpy_dtoh},
        {"cuMemAlloc", (void *)fake_mem_alloc},
        {"cuMemFree", (void *)fake_mem_free},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(symbol, table[i].name) == 0) {
            *pfn = table[i].fn;
            if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
            return CUDA_SUCCESS;
        }
    *pfn = NULL;
    if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
}
