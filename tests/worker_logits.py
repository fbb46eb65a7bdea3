"""Logits of one sequence through a Worker's paged KV cache, chunk by chunk: what the engine
tests (CPU, CUDA, mixture of experts) compare against the float64 reference and each other."""
import numpy as np


def paged_logits(worker, tokens, chunks, keep=False):
    """Logits of every position of one sequence, in prefill chunks of the given sizes (decode is
    a chunk of 1); with keep=True the sequence stays and (logits, seq) is returned."""
    seq = worker.kv.new_sequence()
    while worker.kv.free_blocks * worker.block_size < len(tokens):
        worker.kv.grow(1)
    worker.kv.reserve(seq, len(tokens))
    out, pos = [], 0
    for size in chunks:
        part = tokens[pos:pos + size]
        out.append(worker.forward(part, [0] * len(part), range(pos, pos + len(part)),
                                  [worker.kv.block_table(seq)], range(len(part))))
        pos += size
    logits = np.concatenate(out)
    if keep:
        return logits, seq
    worker.kv.free(seq)
    worker.kv.shrink(worker.kv.stats()["pages_per_layer"])
    return logits
