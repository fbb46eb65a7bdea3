"""A running request taken out of one host with everything it has, to go on in another host
(gyges.Cluster's migrations between hosts, Llumnix-style): its tokens, sampling parameters,
scheduler progress and the KV of every token it has computed, every layer and every KV head.

    packet = host.export_request(request)     # out of this host: its KV freed here
    request = other.import_request(packet)    # in there, on the instance the pool picks

The packet is plain data (lists, a tuple and one NumPy array), so it travels between processes
as it is (Ray's object store). The KV is in the model's own shape whatever the two instances'
plans: `kv[layer, 0 or 1 (K or V), token, kv head, :]`, gathered from every rank of the source
(TP ranks hold slices of the heads, pipeline stages ranges of the layers) and scattered to every
rank of the destination, so a TP1 request can go on in a TP2 instance. Sampling is keyed by
(seed, token index) and the KV is copied exactly, so the request's next tokens are the ones it
would have produced where it was.

Times travel as ages (seconds before the export), since every host has its own clock.
"""
import math
from dataclasses import dataclass

import numpy as np

from ..core.errors import InvalidArgumentError
from .engine import SamplingParams, new_request

STATE_PREEMPTED = 1   # gy_sched_state


@dataclass
class RequestPacket:
    prompt: list            # token ids
    output: list            # the tokens generated so far
    params: SamplingParams
    stop_tokens: np.ndarray  # (n,) int32: what ends it (EOS unless ignored, stop_token_ids)
    # scheduler record: (state, generated, computed, prefill end, preemptions,
    # arrival age, first-scheduled age, first-token age); ages in seconds, nan for never
    record: tuple
    kv: np.ndarray          # (layers, 2, computed tokens, kv heads, head dim) float32, or None
    prompt_text: str = None
    # the model layers kv holds, [first, end) (None: all; a buddy group split between hosts
    # moves each side's part)
    kv_layers: tuple = None
    # the handle's log-probabilities so far (Request's shapes): they go on where it goes
    cumulative_logprob: float = 0.0
    logprobs: list = None
    prompt_logprobs: list = None

    @property
    def kv_bytes(self):
        return 0 if self.kv is None else self.kv.nbytes

    @property
    def computed(self):
        return self.record[2]


def _rank_slices(instance, config):
    """Per rank of `instance`: (its cache, first model layer, end layer, first KV head)."""
    out = []
    for r, kv in enumerate(instance.kvs):
        if instance.stages:
            lo, hi = instance.stages[r]
            out.append((kv, lo, hi, 0))
        else:
            out.append((kv, kv.first_layer, kv.first_layer + kv.n_layers,
                        (r % instance.tp) * kv.n_kv_heads))
    heads = {first + kv.n_kv_heads for kv, _, _, first in out}
    if max(heads) != config.num_key_value_heads:
        raise InvalidArgumentError(f"instance {instance.layout}: its ranks hold "
                                   f"{max(heads)} of {config.num_key_value_heads} KV heads")
    return out


def gather_layers(cache, seq, first, end, n, out=None, head=0):
    """KV of model layers [first, end) of a sequence's first n tokens, as
    out[layer - first, 0 or 1, token, kv head, :] (heads from `head` on: a TP rank's slice)."""
    if out is None:
        out = np.empty((end - first, 2, n, cache.n_kv_heads, cache.head_dim), dtype=np.float32)
    for layer in range(first, end):
        k, v = cache.gather(seq, layer - cache.first_layer, 0, n)
        out[layer - first, 0, :, head:head + cache.n_kv_heads] = k
        out[layer - first, 1, :, head:head + cache.n_kv_heads] = v
    return out


def write_layers(cache, seq, first, kv, head=0):
    """Writes kv[i] (model layer first + i, gather_layers' shape) into a sequence holding
    kv.shape[2] tokens."""
    for i in range(kv.shape[0]):
        cache.write(seq, first + i - cache.first_layer, 0,
                    kv[i, 0, :, head:head + cache.n_kv_heads],
                    kv[i, 1, :, head:head + cache.n_kv_heads])


def export_request(instance, rid, now, layers=None, keep_kv=False):
    """Request `rid` of `instance` as a RequestPacket; the instance then lets it go (its KV is
    freed, or with keep_kv left in the caches for the caller: returns (packet, its sequences)),
    its handle no longer served there, unfinished. layers=(first, end): the KV of those model
    layers only (the instance's ranks must hold them). Nothing changes when it raises."""
    config = instance.host.model.config
    first, end = layers or (0, config.num_hidden_layers)
    ex = instance.export(rid)
    info = ex["info"]
    handle = instance.requests[rid]
    tokens = np.frombuffer(ex["tokens"], dtype=np.int32)
    prompt_len = ex["prompt_len"]
    computed = info["n_computed"] if all(s >= 0 for s in ex["seqs"]) else 0
    kv = None
    if computed > 0:
        kv = np.empty((end - first, 2, computed, config.num_key_value_heads,
                       config.head_dim), dtype=np.float32)
        for (cache, lo, hi, head), seq in zip(_rank_slices(instance, config), ex["seqs"]):
            lo, hi = max(lo, first), min(hi, end)
            if hi > lo:
                gather_layers(cache, seq, lo, hi, computed, kv[lo - first:hi - first], head)

    def age(t):
        return now - t if not math.isnan(t) else math.nan
    record = (info["state_id"], info["n_generated"], computed, info["prefill_end"],
              info["n_preemptions"], age(info["arrival"]), age(info["first_scheduled"]),
              age(info["first_token"]))
    packet = RequestPacket(prompt=tokens[:prompt_len].tolist(),
                           output=tokens[prompt_len:].tolist(), params=handle.params,
                           stop_tokens=np.frombuffer(ex["params"]["stop_tokens"] or b"",
                                                     dtype=np.int32).copy(),
                           record=record, kv=kv, prompt_text=handle.prompt_text,
                           cumulative_logprob=handle.cumulative_logprob,
                           logprobs=None if handle.logprobs is None else list(handle.logprobs),
                           prompt_logprobs=(None if handle.prompt_logprobs is None
                                            else list(handle.prompt_logprobs)),
                           kv_layers=None if layers is None else (first, end))
    if keep_kv:
        instance.attach_kv(rid, [-1] * len(ex["seqs"]))   # forgotten, not freed
        instance.let_go(rid)
        return packet, list(ex["seqs"])
    instance.let_go(rid)
    return packet


def _make_room(cache, tokens):
    """Maps the pages a new sequence of `tokens` tokens needs past the cache's free blocks (the
    engine grows its caches as its requests grow; an imported one arrives whole); returns how
    many pages per layer it mapped."""
    need = -(-tokens // cache.block_size) - cache.free_blocks
    if need <= 0:
        return 0
    pages = math.ceil(need / cache.blocks_per_page())
    cache.grow(pages)
    return pages


def import_request(instance, packet, rid, now, with_kv=True):
    """The request of `packet` served by `instance` under id `rid`, with its KV written into new
    sequences of every rank (or, with_kv=False or without KV, queued to be recomputed); returns
    its handle. Raises OutOfMemoryError, changing nothing, when the KV does not fit."""
    config = instance.host.model.config
    state, generated, computed, prefill_end, preemptions, *ages = packet.record
    if generated != len(packet.output):
        raise InvalidArgumentError(f"packet: {generated} generated tokens recorded, "
                                   f"{len(packet.output)} carried")
    seqs = [-1] * len(instance.kvs)
    kv = packet.kv if with_kv else None
    if kv is not None:
        first, end = packet.kv_layers or (0, config.num_hidden_layers)
        want = (end - first, 2, computed, config.num_key_value_heads, config.head_dim)
        if kv.shape != want:
            raise InvalidArgumentError(f"packet.kv has shape {kv.shape}, this model's KV of "
                                       f"{computed} tokens in layers [{first}, {end}) is {want}")
        slices = _rank_slices(instance, config)
        if any(lo < first or hi > end for _, lo, hi, _ in slices):
            raise InvalidArgumentError(f"packet.kv holds layers [{first}, {end}), not every "
                                       f"layer of instance {instance.layout}")
        made, grown = [], []
        try:
            for r, (cache, lo, hi, head) in enumerate(slices):
                grown.append((cache, _make_room(cache, computed)))
                seq = cache.new_sequence()
                made.append((cache, seq))
                cache.reserve(seq, computed)
                write_layers(cache, seq, lo, kv[lo - first:hi - first], head)
                seqs[r] = seq
        except BaseException:
            for cache, seq in made:
                cache.free(seq)
            for cache, pages in grown:   # the pages mapped for it go back
                if pages:
                    cache.shrink(pages)
            raise
    else:
        computed = prefill_end = 0

    def at(age):
        return now - age if not math.isnan(age) else math.nan
    info = (state, generated, computed, prefill_end, preemptions) + tuple(at(a) for a in ages)
    handle = new_handle(packet, rid, instance.tokenizer, now)
    tokens = np.array(packet.prompt + packet.output, dtype=np.int32)
    try:
        instance.readmit(handle, tokens, packet.stop_tokens, info, seqs)
        return handle
    except BaseException:
        for cache, seq in zip(instance.kvs, seqs):
            if seq >= 0:
                cache.free(seq)
        raise


def new_handle(packet, rid, tokenizer, now):
    """The destination's handle of a moved request: its prompt, the tokens it already has and
    their log-probabilities."""
    handle = new_request(rid, packet.prompt, packet.params, now - packet.record[5], tokenizer,
                         packet.prompt_text)
    for t in packet.output:
        handle._append(t, now)
    handle.cumulative_logprob = packet.cumulative_logprob
    if packet.logprobs is not None:
        handle.logprobs = list(packet.logprobs)
    if packet.prompt_logprobs is not None:
        handle.prompt_logprobs = list(packet.prompt_logprobs)
    return handle


__all__ = ["RequestPacket", "export_request", "import_request", "new_handle", "gather_layers",
           "write_layers"]
