/* kernels.h: every CUDA kernel of gyges, as checked C functions (the third tier of each kernel
 * file; see README.md). Every function returns a gy_status and never aborts: argument errors are
 * GY_ERR_INVALID, a launch or runtime failure GY_ERR_CUDA with the runtime's message and the
 * file and line, and a missing driver or device GY_ERR_UNAVAILABLE.
 *
 * Pointers named in shape comments are device pointers unless said otherwise; launches are
 * asynchronous on `stream` (NULL = the default stream). Outputs come first.
 *
 * dtypes are gy_dtype values (csrc/core/dtype.h): GY_DTYPE_F32, GY_DTYPE_F16, GY_DTYPE_BF16.
 * Compute kernels widen to fp32, compute in fp32, and round once to the output dtype.
 *
 * Only declared when gyges is built with CUDA (GY_WITH_CUDA); nothing else may call them.
 *
 * One header per operation, each including only what it needs; this one includes them all (for
 * the kernels themselves, the Python bindings and tests). Layers above include the header of the
 * operations they use. */
#ifndef GY_KERNELS_KERNELS_H
#define GY_KERNELS_KERNELS_H

#include "attention.h"
#include "device.h"
#include "kv_ops.h"
#include "model_ops.h"
#include "sampling.h"

#endif
