"""Collectives among four virtual workers sharing one GPU (the d2d communicator), against a
plain device-to-device copy of the same bytes.

1. All-reduce (fp32), all-gather and all-to-all of 64 KiB .. 256 MiB per rank: time per call,
   algorithm bandwidth (message bytes / time) and bus bandwidth (NCCL's convention: all-reduce
   x 2(n-1)/n, all-gather and all-to-all x (n-1)/n), beside one cudaMemcpyAsync of the message
   on one stream (a one-rank d2d all-gather). "x copy" is the collective's time in copies of
   one rank's message. On one GPU every rank's traffic shares the same memory, so the floor is
   the traffic in copies (a copy reads and writes its bytes once): the all-reduce's sums read
   4 messages and write 1, then every rank copies the result out (2.5 + 4 = 6.5 copies); the
   all-gather copies 4 x 4 messages (16); the all-to-all 4 x 4 quarters (4). Small messages
   measure the ranks' meeting on the host (two barriers and a GIL hand-off per call from
   Python threads), not the GPU.
2. KV migration of a TP1 -> TP4 merge of a 4-worker host serving the tiny model with 90% of its
   KV blocks in use (Gyges' in-place method: every worker keeps its own KV head and sends each
   peer a quarter of its KV, one all-to-all on the migration communicator): time against the
   bytes moved over the copy bandwidth, for several memory sizes per worker.
3. The migration channel at work: a compute all-reduce of 1 MiB (a 64-token batch of a
   4096-wide model) alone, and while a 256 MiB-per-rank migration all-to-all runs on the
   migration communicator (least-priority streams) of the same ranks.

Each rank is a Python thread calling the collective with its own device buffers (one CUDA arena
per rank), as the CUDA engine's rank threads will; times are host wall time from the ranks'
first call to every rank's stream being done, best of 3. Fixed sizes, no randomness.

Run: .venv/bin/python benchmarks/bench_cuda_comm.py [--quick]
Without a GPU it prints "skipped: <reason>" and exits 0.
"""
import argparse
import gc
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gyges  # noqa: E402
from gyges import _C, _C_test  # noqa: E402
from benchmarks.common import print_table, write_json  # noqa: E402
from gyges.runtime.worker import cuda_device_unavailable  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
PAGE = 2 * MiB
RANKS = 4
SIZES = [64 * KiB << (2 * i) for i in range(7)]  # 64 KiB, 256 KiB, ..., 256 MiB


class RankMemory:
    """One CUDA arena per rank on device 0 (each virtual worker's memory), mapped whole."""

    def __init__(self, nbytes, ranks=RANKS):
        pages = max(1, -(-nbytes // PAGE))
        self.arenas = [gyges.Arena(budget=pages * PAGE, page_size=PAGE, n_slots=pages,
                                   backend="cuda", device=0) for _ in range(ranks)]
        for a in self.arenas:
            a.grow(0, pages, "other")
        self.base = [a.base_address for a in self.arenas]


def run_ranks(fn, ranks=RANKS):
    """Seconds from the moment every rank thread is ready until all have returned."""
    start = threading.Barrier(ranks + 1)
    errors = []

    def body(rank):
        start.wait()
        try:
            fn(rank)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def per_call(comm, call, iters, repeat=3):
    """Best seconds per call of call(rank) repeated `iters` times on every rank."""
    def loop(rank):
        for _ in range(iters):
            call(rank)
        comm.synchronize(rank)

    run_ranks(lambda r: (call(r), comm.synchronize(r)))  # warm-up
    return min(run_ranks(loop) for _ in range(repeat)) / iters


def iterations(nbytes, target_seconds, ceiling=200):
    """Enough calls for ~target_seconds at ~1 TB/s, at least 3."""
    return int(max(3, min(ceiling, target_seconds * 1e12 / max(nbytes, 1) / 4)))


def copy_time(mem, nbytes, target):
    """One D2D copy of nbytes on one stream: a one-rank d2d all-gather."""
    one = _C.Comm(1, "d2d", 0)
    src, dst = mem.base[0], mem.base[0] + nbytes

    def call(rank):
        one.all_gather(0, dst, src, nbytes)

    iters = iterations(nbytes, target)
    call(0)
    one.synchronize(0)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            call(0)
        one.synchronize(0)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def bench_collectives(sizes, target):
    mem = RankMemory((RANKS + 1) * max(sizes))
    comm = _C.Comm(RANKS, "d2d", 0)
    rows = []
    for nbytes in sizes:
        copy = copy_time(mem, nbytes, target)
        iters = iterations(nbytes, target)
        quarter = nbytes // RANKS
        calls = {
            "all_reduce": lambda r: comm.all_reduce(r, mem.base[r], nbytes // 4),
            "all_gather": lambda r: comm.all_gather(r, mem.base[r] + nbytes, mem.base[r],
                                                    nbytes),
            # nbytes sent by every rank, a quarter to each (its own quarter stays)
            "all_to_all": lambda r: comm.all_to_all(
                r, [mem.base[r] + nbytes + s * quarter for s in range(RANKS)], [quarter] * RANKS,
                [mem.base[r] + d * quarter for d in range(RANKS)], [quarter] * RANKS),
        }
        bus = {"all_reduce": 2 * (RANKS - 1) / RANKS, "all_gather": (RANKS - 1) / RANKS,
               "all_to_all": (RANKS - 1) / RANKS}
        for op, call in calls.items():
            seconds = per_call(comm, call, iters)
            # all-gather's message is what each rank ends with (NCCL's convention)
            message = nbytes * RANKS if op == "all_gather" else nbytes
            rows.append({"op": op, "bytes": nbytes, "us": seconds * 1e6,
                         "algbw_GBps": message / seconds / 1e9,
                         "busbw_GBps": message / seconds / 1e9 * bus[op],
                         "copy_us": copy * 1e6, "copy_GBps": nbytes / copy / 1e9,
                         "x_copy": seconds / copy})
    del comm, mem
    gc.collect()
    return rows


def kv_bytes_at_90(memory_per_worker):
    """KV bytes a worker of a 4-worker tiny-model host holds with 90% of its blocks in use."""
    model = gyges.Model.tiny()
    host = gyges.Host(model, workers=RANKS, memory_per_worker=memory_per_worker, layout="4xTP1")
    blocks = host.instances[0].capacity_blocks()
    c = model.config
    per_block = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * host.block_size * 4
    return int(0.9 * blocks) * per_block


def bench_migration(memories, target):
    rows = []
    for memory in memories:
        kv = kv_bytes_at_90(memory)
        quarter = kv // RANKS
        mem = RankMemory(2 * kv)
        migration = _C.Comm(RANKS, "d2d", 0, "migration")

        def call(r):
            # send the three quarters other workers own after the merge; keep our own head
            sizes = [0 if d == r else quarter for d in range(RANKS)]
            migration.all_to_all(r, [mem.base[r] + kv + s * quarter for s in range(RANKS)], sizes,
                                 [mem.base[r] + d * quarter for d in range(RANKS)], sizes)

        seconds = per_call(migration, call, iterations(kv, target, ceiling=20))
        moved = RANKS * (RANKS - 1) * quarter
        copy = copy_time(mem, moved // RANKS, target) * RANKS  # one GPU's memory, shared
        rows.append({"memory_per_worker": memory, "kv_bytes_per_worker": kv,
                     "bytes_moved": moved, "ms": seconds * 1e3, "copy_bound_ms": copy * 1e3,
                     "GBps": moved / seconds / 1e9, "of_copy": copy / seconds})
        del migration, mem
        gc.collect()
    return rows


def bench_channels(target, migration_bytes=256 * MiB, allreduce_bytes=1 * MiB):
    mem = RankMemory(allreduce_bytes + 2 * migration_bytes)
    compute = _C.Comm(RANKS, "d2d", 0, "compute")
    migration = _C.Comm(RANKS, "d2d", 0, "migration")
    n = allreduce_bytes // 4
    quarter = migration_bytes // RANKS
    base = [b + allreduce_bytes for b in mem.base]

    def reduce_call(r):
        compute.all_reduce(r, mem.base[r], n)

    def migrate_once(r):
        sizes = [0 if d == r else quarter for d in range(RANKS)]
        migration.all_to_all(r, [base[r] + migration_bytes + s * quarter for s in range(RANKS)],
                             sizes, [base[r] + d * quarter for d in range(RANKS)], sizes)

    iters = iterations(allreduce_bytes, target)
    alone = per_call(compute, reduce_call, iters)
    # Every rank must make the same number of calls: size the migration to outlast the timing.
    one_migration = per_call(migration, lambda r: migrate_once(r), 3)
    rounds = max(3, int(4 * alone * iters / one_migration) + 1)

    def migrate(r):
        for _ in range(rounds):
            migrate_once(r)
        migration.synchronize(r)

    busy = threading.Thread(target=lambda: run_ranks(migrate))
    busy.start()
    time.sleep(0.002)  # let the migration get going
    during = per_call(compute, reduce_call, iters, repeat=1)
    busy.join()
    priorities = (compute.stream_priority(0), migration.stream_priority(0))
    return [{"allreduce_bytes": allreduce_bytes, "alone_us": alone * 1e6,
             "during_migration_us": during * 1e6, "slowdown": during / alone,
             "migration_rounds": rounds, "migration_ms_each": one_migration * 1e3,
             "compute_priority": priorities[0], "migration_priority": priorities[1]}]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter timings")
    args = parser.parse_args()
    reason = cuda_device_unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        return
    info = _C_test.cuda_device_info(0)
    sizes = SIZES[::3] if args.quick else SIZES
    target = 0.01 if args.quick else 0.05
    collectives = bench_collectives(sizes, target)
    print_table(f"d2d collectives, {RANKS} virtual workers on one {info['name']}", collectives, [
        ("op", "op", "{}"), ("bytes", "bytes", "{:,}"), ("us", "us/call", "{:.1f}"),
        ("algbw_GBps", "algbw GB/s", "{:.1f}"), ("busbw_GBps", "busbw GB/s", "{:.1f}"),
        ("copy_us", "copy us", "{:.1f}"), ("copy_GBps", "copy GB/s", "{:.1f}"),
        ("x_copy", "x copy", "{:.2f}")])
    memories = ["64MiB", "1GiB"] if args.quick else ["64MiB", "1GiB", "4GiB"]
    migration = bench_migration(memories, target)
    print_table("KV migration of a TP1 -> TP4 merge (tiny model, 90% KV), one all-to-all",
                migration, [
                    ("memory_per_worker", "memory/worker", "{}"),
                    ("kv_bytes_per_worker", "KV bytes/worker", "{:,}"),
                    ("bytes_moved", "bytes moved", "{:,}"), ("ms", "ms", "{:.3f}"),
                    ("copy_bound_ms", "moved/copy ms", "{:.3f}"), ("GBps", "GB/s", "{:.1f}"),
                    ("of_copy", "of copy bw", "{:.2f}")])
    channels = bench_channels(target)
    print_table("compute all-reduce beside a migration all-to-all (separate communicators)",
                channels, [
                    ("allreduce_bytes", "bytes", "{:,}"), ("alone_us", "alone us", "{:.1f}"),
                    ("during_migration_us", "during us", "{:.1f}"),
                    ("slowdown", "slowdown", "{:.2f}"),
                    ("compute_priority", "compute prio", "{}"),
                    ("migration_priority", "migration prio", "{}")])
    write_json("bench_cuda_comm", {"device": info["name"], "ranks": RANKS, "quick": args.quick,
                                   "collectives": collectives, "migration": migration,
                                   "channels": channels})


if __name__ == "__main__":
    main()
