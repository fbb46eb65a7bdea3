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

A live migration (Llumnix's, gyges.Cluster.migrate(live=True)) sends the KV in rounds while the
request goes on at its source: each round's packet carries the KV of tokens [kv_start, computed)
only (export_request(..., then="stay")), and the destination writes them into sequences it holds
for the request, a Reservation, before the request itself comes. The last round stops it
(then="hold": its KV kept at the source until the destination has it, so a refusal puts it back
as it was) and import_request(..., reservation=) adopts it with the reserved sequences. A token's
KV never changes once computed (a preempted request recomputes the same bytes), so the ranges of
earlier rounds stay valid; only a request that has computed fewer tokens since (preempted) is
sent again from token 0.

A packet may carry the KV of some layers only (kv_layers): a KunServe buddy group split between
two hosts moves each request's KV of the layers its host no longer serves
(reconfig/split_buddy.py).
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
    kv: np.ndarray          # (layers in kv_layers, 2, computed - kv_start, kv heads, head dim)
    #                         float32, or None
    prompt_text: str = None
    # the handle's log-probabilities so far (Request's shapes): they go on where it goes
    cumulative_logprob: float = 0.0
    logprobs: list = None
    prompt_logprobs: list = None
    kv_start: int = 0       # kv holds tokens [kv_start, computed): a live migration sent the rest
    # the model layers kv holds, [first, end) (None: all of them)
    kv_layers: tuple = None

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


def gather_layers(cache, seq, first, end, start, n, out=None, head=0):
    """KV of model layers [first, end) of a sequence's tokens [start, start + n), as
    out[layer - first, 0 or 1, token, kv head, :] (heads from `head` on: a TP rank's slice)."""
    if out is None:
        out = np.empty((end - first, 2, n, cache.n_kv_heads, cache.head_dim), dtype=np.float32)
    for layer in range(first, end):
        k, v = cache.gather(seq, layer - cache.first_layer, start, n)
        out[layer - first, 0, :, head:head + cache.n_kv_heads] = k
        out[layer - first, 1, :, head:head + cache.n_kv_heads] = v
    return out


def write_layers(cache, seq, first, kv, start=0, head=0):
    """Writes kv[i] (model layer first + i, gather_layers' shape) into a sequence's tokens
    [start, start + kv.shape[2])."""
    for i in range(kv.shape[0]):
        cache.write(seq, first + i - cache.first_layer, start,
                    kv[i, 0, :, head:head + cache.n_kv_heads],
                    kv[i, 1, :, head:head + cache.n_kv_heads])


def _layers(config, layers):
    first, end = layers or (0, config.num_hidden_layers)
    return first, end


def _gather(instance, config, seqs, start, end, layers=None):
    """The KV of tokens [start, end) of model layers `layers` (all: None) from every rank's
    sequence, in the model's shape."""
    first, last = _layers(config, layers)
    kv = np.empty((last - first, 2, end - start, config.num_key_value_heads, config.head_dim),
                  dtype=np.float32)
    for (cache, lo, hi, head), seq in zip(_rank_slices(instance, config), seqs):
        lo, hi = max(lo, first), min(hi, last)
        if hi > lo:
            gather_layers(cache, seq, lo, hi, start, end - start, kv[lo - first:hi - first], head)
    return kv


THEN = ("let_go", "stay", "hold")


def export_request(instance, rid, now, start=0, then="let_go", layers=None):
    """Request `rid` of `instance` as a RequestPacket whose KV is that of tokens [start,
    computed) (from token 0 when it has computed fewer than `start`: packet.kv_start says) of
    model layers `layers` = (first, end) (None: all).
    then: "let_go" (the instance lets it go: its KV freed, its handle unfinished and served
    no more), "stay" (it goes on here: a live migration's round), or "hold" (served no more,
    its KV kept: returns (packet, Held)). Nothing changes when it raises."""
    config = instance.host.model.config
    ex = instance.export(rid)
    info = ex["info"]
    handle = instance.requests[rid]
    tokens = np.frombuffer(ex["tokens"], dtype=np.int32)
    prompt_len = ex["prompt_len"]
    computed = info["n_computed"] if all(s >= 0 for s in ex["seqs"]) else 0
    start = start if start <= computed else 0
    kv = (_gather(instance, config, ex["seqs"], start, computed, layers) if computed > start
          else None)

    def age(t):
        return now - t if not math.isnan(t) else math.nan
    record = (info["state_id"], info["n_generated"], computed, info["prefill_end"],
              info["n_preemptions"], age(info["arrival"]), age(info["first_scheduled"]),
              age(info["first_token"]))
    stop_tokens = np.frombuffer(ex["params"]["stop_tokens"] or b"", dtype=np.int32).copy()
    packet = RequestPacket(prompt=tokens[:prompt_len].tolist(),
                           output=tokens[prompt_len:].tolist(), params=handle.params,
                           stop_tokens=stop_tokens, record=record, kv=kv,
                           prompt_text=handle.prompt_text,
                           cumulative_logprob=handle.cumulative_logprob,
                           logprobs=None if handle.logprobs is None else list(handle.logprobs),
                           prompt_logprobs=(None if handle.prompt_logprobs is None
                                            else list(handle.prompt_logprobs)),
                           kv_start=start, kv_layers=layers and tuple(layers))
    if then == "stay":
        return packet
    if then == "let_go":
        instance.let_go(rid)
        return packet
    held = Held(instance, handle, tokens.copy(), stop_tokens, instance.record(rid),
                list(ex["seqs"]))
    instance.attach_kv(rid, [-1] * len(held.seqs))   # its sequences are the Held's now
    try:
        instance.let_go(rid)
    except BaseException:
        instance.attach_kv(rid, held.seqs)
        raise
    return packet, held


@dataclass
class Held:
    """A request a live migration's last round took out of `instance`, its KV sequences kept
    until its destination has it (free) or cannot take it (restore: served here again as it
    was, with its KV)."""
    instance: object
    handle: object
    tokens: np.ndarray       # prompt then output
    stop_tokens: np.ndarray
    record: tuple            # Instance.record() at the stop (this host's clock)
    seqs: list               # per rank, -1 for none

    @property
    def workers(self):
        return self.instance.workers

    def restore(self):
        self.instance.readmit(self.handle, self.tokens, self.stop_tokens, self.record, self.seqs)

    def free(self):
        for cache, seq in zip(self.instance.kvs, self.seqs):
            if seq >= 0:
                cache.free(seq)
        self.seqs = [-1] * len(self.seqs)


def _make_room(cache, blocks):
    """Maps the pages `blocks` more blocks need past the cache's free ones (the engine grows its
    caches as its requests grow; moved KV arrives whole); returns how many pages per layer it
    mapped."""
    need = blocks - cache.free_blocks
    if need <= 0:
        return 0
    pages = math.ceil(need / cache.blocks_per_page())
    cache.grow(pages)
    return pages


class Reservation:
    """A sequence on every rank of `instance` holding the KV of a request's tokens [0, tokens),
    written range by range before the request comes (a live migration's rounds), then adopted
    with it (import_request). free() gives back the sequences and the pages mapped for them."""

    def __init__(self, instance):
        self.instance = instance
        self.tokens = 0
        self.seqs = [-1] * len(instance.kvs)
        self.grown = [0] * len(instance.kvs)

    @property
    def workers(self):
        return self.instance.workers

    def take(self, packet):
        """Brings the sequences to the packet's KV, tokens [0, packet.computed): what it carries
        is written past what they hold. A request that has computed fewer tokens since
        (preempted at its source) starts over. When it raises, the reservation is freed."""
        kv = packet.kv
        if packet.computed < self.tokens or (self.tokens and kv is not None
                                             and packet.kv_start == 0):
            self.free()
        if kv is None:
            return
        config = self.instance.host.model.config
        start, n = packet.kv_start, packet.computed - packet.kv_start
        first, last = _layers(config, packet.kv_layers)
        want = (last - first, 2, n, config.num_key_value_heads, config.head_dim)
        if kv.shape != want or start != self.tokens:
            self.free()
            raise InvalidArgumentError(f"packet.kv has shape {kv.shape} from token {start}; "
                                       f"this model's KV of tokens [{self.tokens}, "
                                       f"{packet.computed}) in layers [{first}, {last}) is {want}")
        slices = _rank_slices(self.instance, config)
        if any(lo < first or hi > last for _, lo, hi, _ in slices):
            self.free()
            raise InvalidArgumentError(f"packet.kv holds layers [{first}, {last}), not every "
                                       f"layer of instance {self.instance.layout}")
        end = start + n
        try:
            for r, (cache, lo, hi, head) in enumerate(slices):
                if self.seqs[r] < 0:
                    self.seqs[r] = cache.new_sequence()
                blocks = -(-end // cache.block_size) - (-(-start // cache.block_size))
                self.grown[r] += _make_room(cache, blocks)
                cache.reserve(self.seqs[r], end)
                write_layers(cache, self.seqs[r], lo, kv[lo - first:hi - first], start, head)
        except BaseException:
            self.free()
            raise
        self.tokens = end

    def free(self):
        for r, cache in enumerate(self.instance.kvs):
            if self.seqs[r] >= 0:
                cache.free(self.seqs[r])
            if self.grown[r]:   # the pages mapped for it go back, where nothing uses them
                pages = min(self.grown[r], cache.shrinkable())
                if pages:
                    cache.shrink(pages)
        self.tokens = 0
        self.seqs = [-1] * len(self.instance.kvs)
        self.grown = [0] * len(self.instance.kvs)


def import_request(instance, packet, rid, now, with_kv=True, reservation=None):
    """The request of `packet` served by `instance` under id `rid`, with its KV written into new
    sequences of every rank, or into `reservation`'s (a Reservation of this instance, which
    holds its tokens before packet.kv_start; it ends here either way), or, with_kv=False or
    without KV, queued to be recomputed; returns its handle. Raises OutOfMemoryError, changing
    nothing, when the KV does not fit."""
    state, generated, computed, prefill_end, preemptions, *ages = packet.record
    if generated != len(packet.output):
        raise InvalidArgumentError(f"packet: {generated} generated tokens recorded, "
                                   f"{len(packet.output)} carried")
    res = reservation if reservation is not None else Reservation(instance)
    try:
        if with_kv:
            res.take(packet)
        if not with_kv or res.tokens != computed or computed == 0:
            res.free()   # recomputed from its tokens
            computed = prefill_end = 0

        def at(age):
            return now - age if not math.isnan(age) else math.nan
        info = (state, generated, computed, prefill_end, preemptions) + tuple(at(a) for a in ages)
        handle = new_handle(packet, rid, instance.tokenizer, now)
        tokens = np.array(packet.prompt + packet.output, dtype=np.int32)
        instance.readmit(handle, tokens, packet.stop_tokens, info, res.seqs)
        return handle
    except BaseException:
        res.free()
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


__all__ = ["Held", "RequestPacket", "Reservation", "export_request", "gather_layers",
           "import_request", "new_handle", "write_layers"]
