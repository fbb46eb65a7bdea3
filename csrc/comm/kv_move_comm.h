/* kv_move_comm.h: the comm backend of KV moves (kv/kv_move.h): caches on several CUDA devices,
 * the ranks of the move's communicator (a group's migration communicator), moved by the phased
 * all-to-all of Gyges 4.1.2. kv/ knows nothing of it: a program that moves KV between GPUs
 * registers it at start-up (the extension does at import), as it does the device backend.
 *
 * One move is one phase (a round of plans.AllToAllPlan). Rank r is the communicator's rank
 * whose device holds a cache; each rank runs on a thread of its own (made here, one per rank,
 * for the length of the move: NCCL wants one caller per rank), on its migration stream:
 *   1. items whose two caches are on its device: the device backend's head-copy kernel;
 *   2. for each layer: pack, for every other rank d, the heads of its items going to d into
 *      one contiguous staging buffer (the head-copy kernel into a header-layout staging
 *      "cache" of the item's heads, block j = pair j), exchange with gy_comm_all_to_all
 *      (ncclGroupStart, paired ncclSend/ncclRecv, ncclGroupEnd), unpack what arrived into the
 *      destination caches' blocks;
 *   3. wait for its stream, free its staging.
 * The staging of one layer is the only extra memory (stats->staging_bytes): the layers reuse
 * it, so a phase costs 1/L of its KV twice over (sent and received) per rank.
 *
 * Failure: a rank that fails (its staging, a copy, an injected fault) aborts the communicator,
 * so every other rank's next all-to-all fails at once instead of waiting; the move returns the
 * first failure after every thread has ended and resets the communicator. Sources are only
 * read; a destination block may hold part of what it was to receive (the callers receive only
 * into blocks nobody reads yet, and their journals take back the moves that completed).
 *
 * OVERLAP moves (a layer-staggered transformation: each new cache is a shadow over its old
 * cache's pages, so destinations lie over sources): staging holds every layer of the move
 * (a staggered step moves one or two), and items on one device go through it too, the pairs
 * already in place left out (stats->bytes_in_place, as on the host). Each rank packs every
 * source it holds, every layer, and takes part in every layer's exchange; the ranks then meet
 * at a barrier (they are threads of this process) and write, from staging, only if none
 * failed. So every fallible step (staging, the exchanges, the injected faults) comes before
 * the first write anywhere, and a failed OVERLAP move leaves every cache as it was. */
#ifndef GY_COMM_KV_MOVE_COMM_H
#define GY_COMM_KV_MOVE_COMM_H

#include "../kv/kv_move_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* gy_kv_move_set_backend(GY_KV_MOVE_BACKEND_COMM, &gy_kv_move_comm_backend); without CUDA it
 * registers nothing (there are no device caches) and returns GY_OK. */
gy_status gy_kv_move_comm_register(void);

#ifdef GY_WITH_CUDA
extern const gy_kv_move_backend gy_kv_move_comm_backend;
#endif

#ifdef __cplusplus
}
#endif
#endif
