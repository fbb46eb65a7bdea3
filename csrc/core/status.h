/* status.h: how the C core reports failure.
 *
 * The core never exits or aborts. Every fallible function returns a gy_status; on failure it has
 * also written a message naming the cause (and the file and line that detected it) into a
 * thread-local buffer that the Python layer turns into an exception. */
#ifndef GY_CORE_STATUS_H
#define GY_CORE_STATUS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum gy_status {
    GY_OK = 0,
    GY_ERR_INVALID = 1,      /* bad argument: size, alignment, range, dtype */
    GY_ERR_OUT_OF_MEMORY = 2,/* a physical budget (the "GPU memory") would be exceeded */
    GY_ERR_STATE = 3,        /* the call does not fit the current state: double map, double free */
    GY_ERR_BUSY = 4,         /* a live view or an ongoing operation holds the resource */
    GY_ERR_SYSTEM = 5,       /* the OS refused (mmap, memfd, fallocate) */
    GY_ERR_CUDA = 6,         /* the CUDA driver or runtime refused */
    GY_ERR_UNAVAILABLE = 7,  /* a backend that is not compiled in or has no device */
    GY_ERR_LIMIT = 8,        /* a fixed limit such as vm.max_map_count would be crossed */
    GY_ERR_FORMAT = 9,       /* malformed input data (checkpoint files, traces) */
    GY_STATUS_COUNT
} gy_status;

/* Records a failure and returns it, so that call sites read `return GY_FAIL(...)`. */
gy_status gy_error_set(gy_status status, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
#define GY_FAIL(status, ...) gy_error_set((status), __FILE__, __LINE__, __VA_ARGS__)

/* The message of the last failure on this thread ("" when none). */
const char *gy_error_message(void);
void gy_error_clear(void);
const char *gy_status_name(gy_status status);

/* Propagates a failure from a callee, keeping its message. */
#define GY_TRY(expr)                                                                               \
    do {                                                                                           \
        gy_status gy_try_status_ = (expr);                                                         \
        if (gy_try_status_ != GY_OK) return gy_try_status_;                                        \
    } while (0)

#ifdef __cplusplus
}
#endif
#endif
