"""gyges.Engine: a continuous-batching LLM engine on one worker.

    m = gyges.Model.tiny()
    eng = gyges.Engine(m, memory="256MiB", page_size="64KiB", block_size=16, kv_layout="header")
    outs = eng.generate([[1, 2, 3], [4, 5]], gyges.SamplingParams(max_tokens=32, temperature=0.0))
    r = eng.submit([1, 2, 3], gyges.SamplingParams(max_tokens=8)); eng.step()
    r.output_tokens, r.finished, r.metrics

The loop (scheduler, forward pass, sampler) is C; this file owns the request handles, the
timestamps and the argument checks.
"""
import math
import operator
import time
from dataclasses import dataclass, field

import numpy as np

from . import _C
from .units import parse_size
from .worker import Worker


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 is greedy; top_k 0 and top_p 1 are
    off; the seed makes sampling reproducible per request (independent of the batch)."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")


@dataclass
class RequestMetrics:
    """Per-request timestamps (seconds since the engine started) and vLLM's latencies."""
    arrival: float
    scheduled: float = math.nan
    first_token: float = math.nan
    finish: float = math.nan
    token_times: list = field(default_factory=list)

    @property
    def ttft(self):
        return self.first_token - self.arrival

    @property
    def e2e(self):
        return self.finish - self.arrival

    @property
    def tpot(self):
        n = len(self.token_times)
        return (self.finish - self.first_token) / (n - 1) if n > 1 else math.nan

    @property
    def itl(self):
        return np.diff(np.asarray(self.token_times))


class Request:
    """A submitted request: its tokens so far, whether it finished, and its metrics."""

    def __init__(self, request_id, prompt, params, arrival):
        self.id = request_id
        self.prompt = list(prompt)
        self.params = params
        self.output_tokens = []
        self.finished = False
        self.finish_reason = None
        self.metrics = RequestMetrics(arrival=arrival)

    def __repr__(self):
        state = f"finished ({self.finish_reason})" if self.finished else "running"
        return (f"Request(id={self.id}, prompt={len(self.prompt)} tokens, "
                f"output={len(self.output_tokens)} tokens, {state})")


def check_prompt(tokens, vocab):
    """A list of ints in [0, vocab); raises ValueError naming the problem."""
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        raise ValueError(f"a prompt must be a sequence of token ids, got {type(tokens).__name__}")
    if len(tokens) == 0:
        raise ValueError("a prompt must have at least one token")
    try:
        array = np.array([operator.index(t) for t in tokens], dtype=np.int64)
    except TypeError:
        raise ValueError("token ids must be integers") from None
    bad = np.flatnonzero((array < 0) | (array >= vocab))
    if bad.size:
        raise ValueError(f"token {array[bad[0]]} at index {bad[0]} is outside the vocabulary "
                         f"[0, {vocab})")
    return array.astype(np.int32)


class InstanceLoop:
    """The Python side of one C serving loop (gyges._C.Engine over one or several TP ranks): the
    request handles it serves and their timestamps. Engine has one; a Host has one per instance."""

    def __init__(self, c_engine, config, clock):
        self._c = c_engine
        self.config = config
        self.clock = clock
        self.requests = {}

    def add(self, request_id, tokens, params, arrival=None):
        prompt = check_prompt(tokens, self.config.vocab_size)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.config.eos_tokens())
        arrival = self.clock() if arrival is None else float(arrival)
        request = Request(request_id, prompt.tolist(), params, arrival)
        self._c.add(request.id, prompt, params.max_tokens, float(params.temperature),
                    params.top_k, float(params.top_p), params.seed,
                    np.array(sorted(stops), dtype=np.int32), arrival)
        self.requests[request.id] = request
        return request

    def unfinished(self):
        return sum(1 for r in self.requests.values() if not r.finished)

    def step(self):
        """One C step; returns the tokens it ran through the model."""
        tokens, finished, batch_tokens, _ = self._c.step(self.clock())
        done = self.clock()
        for request_id, token in tokens:
            r = self.requests[request_id]
            r.output_tokens.append(token)
            r.metrics.token_times.append(done)
        for request_id in finished:
            r = self.requests.pop(request_id)
            info = self._c.info(request_id)
            r.finished = True
            r.finish_reason = info["finish"]
            r.metrics.scheduled = info["first_scheduled"]
            r.metrics.first_token = r.metrics.token_times[0] if r.metrics.token_times else math.nan
            r.metrics.finish = done
            self._c.release(request_id)
        return batch_tokens


class Serving:
    """run() and generate() for anything with submit(), step() and has_unfinished()."""

    def run(self):
        """Steps until every submitted request has finished."""
        while self.has_unfinished():
            self.step()

    def generate(self, prompts, params=None):
        """Submits every prompt, runs to completion, returns the request handles in order."""
        requests = [self.submit(p, params) for p in prompts]
        self.run()
        return requests


class Engine(Serving):
    """Engine(model, memory="256MiB", page_size=None, block_size=16, kv_layout="header",
    weight_dtype="f32", threads=2, max_batch_tokens=512, max_running=64, max_prefill_chunk=0,
    max_tp=None, max_pos=None, pad_ffn=True, backend="cpu", device=0)

    backend="cuda" serves from GPU `device` with the same loop, scheduler and sampler: only the
    forward pass runs there (page_size then defaults to 2MiB, the driver's granularity).
    """

    def __init__(self, model, memory="256MiB", page_size=None, block_size=16,
                 kv_layout="header", weight_dtype="f32", threads=2, max_batch_tokens=512,
                 max_running=64, max_prefill_chunk=0, max_tp=None, max_pos=None, pad_ffn=True,
                 backend="cpu", device=0):
        for name, value in (("block_size", block_size), ("max_batch_tokens", max_batch_tokens),
                            ("max_running", max_running), ("threads", threads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.model = model
        self.worker = Worker(model, memory=memory, page_size=page_size, block_size=block_size,
                             kv_layout=kv_layout, weight_dtype=weight_dtype, max_tp=max_tp,
                             threads=threads, max_pos=max_pos, pad_ffn=pad_ffn,
                             backend=backend, device=device)
        self._start = time.perf_counter()
        self._c = _C.Engine([self.worker.c_model], [self.worker.kv._c], None, max_batch_tokens,
                            max_running, max_prefill_chunk)
        self._loop = InstanceLoop(self._c, model.config, self.now)
        self._next_id = 0
        self.steps = 0
        self.memory_budget = parse_size(memory, "memory")

    # ---- state ----
    @property
    def arena(self):
        return self.worker.arena

    @property
    def kv(self):
        return self.worker.kv

    @property
    def weights(self):
        return self.worker.weights

    def now(self):
        return time.perf_counter() - self._start

    def memory(self):
        """Bytes of the worker's budget: in use, by owner, and the KV cache's blocks."""
        s = self.arena.stats()
        kv = self.kv.stats()
        return {"budget": s["budget_bytes"], "in_use": s["bytes_in_use"], "peak": s["peak_bytes"],
                "weights": s["bytes_by_tag"]["weights"], "kv": s["bytes_by_tag"]["kv"],
                "weight_padding": self.weights.padding_bytes, "kv_blocks": kv["n_blocks"],
                "kv_free_blocks": kv["free_blocks"], "kv_block_bytes": kv["block_bytes"]}

    def has_unfinished(self):
        return self._loop.unfinished() > 0

    # ---- requests ----
    def submit(self, tokens, params=None, arrival=None):
        """Queues a request and returns its handle. Raises ValueError for a bad prompt or
        parameters and InvalidArgumentError when it could never fit in this worker's memory."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a gyges.SamplingParams")
        request = self._loop.add(self._next_id, tokens, params, arrival)
        self._next_id += 1
        return request

    def abort(self, request):
        self._c.abort(request.id)

    def step(self):
        """Runs one engine step; returns the number of tokens it ran through the model."""
        batch_tokens = self._loop.step()
        if batch_tokens:
            self.steps += 1
        return batch_tokens

    def stats(self):
        return self._c.stats()
