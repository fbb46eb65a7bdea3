/* kv_move_device.h: the device backend of KV moves (kv/kv_move.h): caches on one CUDA device
 * (virtual workers sharing a GPU) copied by the head-copy kernel (kv_copy_heads.cu), no byte
 * through the host. kv/ knows nothing of it: a program that moves KV on a device registers it
 * at start-up (the extension does at import). */
#ifndef GY_KERNELS_KV_MOVE_DEVICE_H
#define GY_KERNELS_KV_MOVE_DEVICE_H

#include "../kv/kv_move_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* gy_kv_move_set_backend(GY_KV_MOVE_BACKEND_DEVICE, &gy_kv_move_device_backend); without CUDA
 * it registers nothing (there are no device caches) and returns GY_OK. */
gy_status gy_kv_move_device_register(void);

#ifdef GY_WITH_CUDA
/* The table itself (tests run it against the host's). */
extern const gy_kv_move_backend gy_kv_move_device_backend;
#endif

#ifdef __cplusplus
}
#endif
#endif
