"""The requests a transformation moves: what each holds where before (collect), and the hand-
over to the new instance in C with their progress, sampling state and new KV sequences
(Instance.take -> gy_engine_take), so that they continue without recomputation."""
from dataclasses import dataclass


@dataclass(frozen=True)
class MovedRequest:
    id: int
    source: object           # the Instance it leaves
    seqs: tuple              # per old rank: its KV sequence there, -1 for none
    tables: tuple            # per old rank: its block table there (int32 array), or None
    n_tokens: tuple          # per old rank: tokens of KV there

    @property
    def kv_tokens(self):
        """Tokens of KV it holds (0: still queued)."""
        return max(self.n_tokens, default=0)


def collect(instance, host):
    """Every unfinished request of an instance, with its KV on each rank."""
    out = []
    for rid in instance.request_ids():
        seqs = tuple(instance.request_seqs(rid))
        tables, n_tokens = [], []
        for rank, seq in enumerate(seqs):
            kv = host.worker(instance.workers[rank]).kv
            tables.append(kv.block_table(seq) if seq >= 0 else None)
            n_tokens.append(kv.n_tokens(seq) if seq >= 0 else 0)
        out.append(MovedRequest(rid, instance, seqs, tuple(tables), tuple(n_tokens)))
    return out


def hand_over(instance, moved, seqs_of, taken=None):
    """The new instance takes every moved request from its source; seqs_of(request id) -> its
    KV sequence in each of the new instance's ranks' caches. `taken` (a list) gets each request
    once it has moved, for hand_back."""
    for req in moved:
        instance.take(req.source, req.id, seqs_of(req.id))
        if taken is not None:
            taken.append(req)


def hand_back(instance, taken, seqs_of):
    """Undoes hand_over: every request in `taken` goes back to its source, newest first, with
    seqs_of(request) as its KV sequences there."""
    while taken:
        req = taken[-1]
        if req.id in instance.requests:  # (one that finished meanwhile has nothing to move)
            req.source.take(instance, req.id, seqs_of(req))
        taken.pop()
