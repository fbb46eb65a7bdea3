/* status.c: the thread-local error message behind gy_status. */
#include "status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define GY_ERROR_CAPACITY 1024

static _Thread_local char gy_error_buffer[GY_ERROR_CAPACITY];

gy_status gy_error_set(gy_status status, const char *file, int line, const char *fmt, ...) {
    char message[GY_ERROR_CAPACITY - 128];
    va_list args;
    va_start(args, fmt);
    vsnprintf(message, sizeof message, fmt, args);
    va_end(args);
    /* Keep only the file's base name: the message is for users, the line for us. */
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    snprintf(gy_error_buffer, sizeof gy_error_buffer, "%s [%s:%d]", message, base, line);
    return status;
}

const char *gy_error_message(void) { return gy_error_buffer; }

void gy_error_clear(void) { gy_error_buffer[0] = '\0'; }

const char *gy_status_name(gy_status status) {
    switch (status) {
    case GY_OK: return "ok";
    case GY_ERR_INVALID: return "invalid argument";
    case GY_ERR_OUT_OF_MEMORY: return "out of memory";
    case GY_ERR_STATE: return "invalid state";
    case GY_ERR_BUSY: return "busy";
    case GY_ERR_SYSTEM: return "system error";
    case GY_ERR_CUDA: return "CUDA error";
    case GY_ERR_UNAVAILABLE: return "unavailable";
    case GY_ERR_LIMIT: return "limit exceeded";
    case GY_ERR_FORMAT: return "malformed data";
    default: return "unknown status";
    }
}
