"""Pure plans of a transformation: who becomes which rank, where each request goes, which KV
block goes where in which round. Frozen values computed from numbers and tables alone, so they
are tested without a host (tests/test_transform_plans.py); the executors (at_once.py,
staggered.py) carry them out.

Rank maps (Gyges 4.1, AMOEBAs 3): merging m instances of TPt into TPk (k = m*t), worker
(instance j, old rank r) becomes rank r*m + j, so that the KV heads and FFN shards it keeps are
a subset of those it has. Splitting TPk into m instances of TPt, new rank r of instance j is
worker first + j*t + r and gathers its heads from old ranks r*m .. r*m + m-1 (sub-group g of its
heads from old rank r*m + g)."""
from dataclasses import dataclass

from ..core.errors import InvalidArgumentError


class TransformError(InvalidArgumentError):
    """A transformation that cannot be carried out; nothing was changed."""


@dataclass(frozen=True)
class MergePlan:
    """Scale-up of the instances on workers [first, first+k) into one TPk instance."""
    first: int
    k: int
    t: int                   # the old instances' TP degree
    old_workers: tuple       # per old instance j (by first worker): its workers in rank order

    @classmethod
    def of(cls, old_workers, first, k):
        """Checks that the old instances cover the aligned group exactly, all of one TP degree
        below k."""
        old_workers = tuple(tuple(ws) for ws in old_workers)
        group = set(range(first, first + k))
        if sum(len(ws) for ws in old_workers) != k or any(w not in group for ws in old_workers for w in ws):
            raise TransformError(f"workers {sorted(group)} are not exactly covered by instances "
                                 f"inside the group; busy in another group")
        degrees = [len(ws) for ws in old_workers]
        if len(set(degrees)) != 1 or degrees[0] >= k:
            raise TransformError(f"scale-up merges instances of one TP degree below TP{k}; found "
                                 f"{degrees}")
        return cls(first, k, degrees[0], old_workers)

    @property
    def m(self):
        return self.k // self.t

    def worker_of(self, j, r):
        return self.old_workers[j][r]

    @property
    def new_rank(self):
        """worker -> its rank in the merged instance."""
        return {self.worker_of(j, r): r * self.m + j for j in range(self.m) for r in range(self.t)}

    @property
    def rank_order(self):
        """The merged instance's workers in rank order."""
        rank = self.new_rank
        return tuple(sorted(rank, key=rank.get))


@dataclass(frozen=True)
class SplitPlan:
    """Scale-down of the TPk instance on workers [first, first+k) into k/tp instances of TPtp."""
    first: int
    k: int
    tp: int
    rank_worker: tuple       # old rank -> worker

    @classmethod
    def of(cls, rank_worker, first, k, tp):
        if tp >= k or k % tp:
            raise TransformError(f"scale-down goes from TP{k} to a smaller divisor, not TP{tp}")
        return cls(first, k, tp, tuple(rank_worker))

    @property
    def m(self):
        return self.k // self.tp

    def worker_of(self, j, r):
        """Worker of new rank r of new instance j."""
        return self.first + j * self.tp + r

    @property
    def new_ranks(self):
        """[((instance j, rank r), worker)] of the new instances."""
        return [((j, r), self.worker_of(j, r)) for j in range(self.m) for r in range(self.tp)]

    def instance_workers(self, j):
        return [self.worker_of(j, r) for r in range(self.tp)]


def balance(kv_tokens, m, block_size):
    """Spreads requests over m new instances by the KV blocks they hold, largest first.
    kv_tokens: [(request id, tokens of KV)]. Returns (request id -> instance, blocks per
    instance)."""
    load, target = [0] * m, {}
    for rid, n in sorted(kv_tokens, key=lambda x: -x[1]):
        j = min(range(m), key=lambda i: load[i])
        target[rid] = j
        load[j] += -(-n // block_size)
    return target, load


def chunk(items, c, chunks):
    """The c-th of `chunks` nearly equal consecutive parts of a list."""
    n = len(items)
    return items[c * n // chunks:(c + 1) * n // chunks]


@dataclass(frozen=True)
class AllToAllPlan:
    """The in-place KV migration of a scale-up (header-centric layout, Gyges 4.1.2).

    After the reshape old block b of a worker is blocks m*b .. m*b+m-1 of H/k heads, one per
    sub-group g. The worker of old instance j keeps sub-group j of its own requests in place and
    receives the other instances' requests' sub-group j in m-1 phases, phase s from instance
    (j - s) mod m; each phase is cut into `chunks` rounds. A round receives only into blocks
    that were free from the start or that an earlier round sent away, so only the first rounds
    map new blocks past the mapped ones (Figure 5d)."""
    dest: dict        # worker -> request id -> its block table in the new geometry
    end_block: dict   # worker -> blocks it needs mapped (>= those mapped before)
    rounds: dict      # (phase, chunk) -> (src worker, dst worker) -> (src blocks, dst blocks)


def plan_all_to_all(plan, tables, n_blocks, mapped, chunks):
    """tables: (instance j, old rank r) -> [(request id, old block table)] of the requests with
    KV there; n_blocks: worker -> its blocks before the reshape; mapped: worker -> its blocks
    after the reshape (the pages already mapped, read as smaller blocks)."""
    m = plan.m
    dest = {w: {} for ws in plan.old_workers for w in ws}
    end_block, rounds = {}, {}
    for r in range(plan.t):
        col = [plan.worker_of(j, r) for j in range(m)]
        local = {j: [(rid, [int(b) for b in tab]) for rid, tab in tables.get((j, r), ())]
                 for j in range(m)}
        pool, next_block = {}, {}
        for j, w in enumerate(col):
            used = {b for _, tab in local[j] for b in tab}
            # Free from the start: every sub-block of an unused old block, and any tail the
            # smaller blocks add. Kept in place: the sub-group this worker's new rank owns.
            free = [m * b + g for b in range(n_blocks[w]) if b not in used for g in range(m)]
            free += list(range(m * n_blocks[w], mapped[w]))
            pool[w] = sorted(free, reverse=True)  # pop() hands out the lowest block first
            next_block[w] = mapped[w]
            for rid, tab in local[j]:
                dest[w][rid] = [m * b + j for b in tab]
        outgoing = {j: [b for _, tab in local[j] for b in tab] for j in range(m)}
        length = {rid: len(tab) for j in range(m) for rid, tab in local[j]}
        for s in range(1, m):
            incoming = {j: [(rid, i, b) for rid, tab in local[(j - s) % m] for i, b in enumerate(tab)]
                        for j in range(m)}
            for c in range(chunks):
                for j, w in enumerate(col):
                    src = col[(j - s) % m]
                    for rid, i, b in chunk(incoming[j], c, chunks):
                        if pool[w]:
                            block = pool[w].pop()
                        else:  # no freed block left: map a new one (the extra memory)
                            block = next_block[w]
                            next_block[w] += 1
                        dest[w].setdefault(rid, [None] * length[rid])[i] = block
                        pair = rounds.setdefault((s, c), {}).setdefault((src, w), ([], []))
                        pair[0].append(b)
                        pair[1].append(block)
                for j, w in enumerate(col):  # what this round sent away is free for the next
                    freed = [m * b + (j + s) % m for b in chunk(outgoing[j], c, chunks)]
                    pool[w] = sorted(freed + pool[w], reverse=True)
        end_block.update(next_block)
    return AllToAllPlan(dest, end_block, rounds)
