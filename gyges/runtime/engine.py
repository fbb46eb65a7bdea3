"""gyges.Engine: a continuous-batching LLM engine on one worker.

    m = gyges.Model.tiny()
    eng = gyges.Engine(m, memory="256MiB", page_size="64KiB", block_size=16, kv_layout="header")
    outs = eng.generate([[1, 2, 3], [4, 5]], gyges.SamplingParams(max_tokens=32, temperature=0.0))
    r = eng.submit([1, 2, 3], gyges.SamplingParams(max_tokens=8)); eng.step()
    r.output_tokens, r.finished, r.metrics

The loop (scheduler, forward pass, sampler) is C; this file owns the request handles, the
timestamps and the argument checks.

Guarantees (README "Guarantees"): a bad argument raises a gyges.Error naming it and changes
nothing; a failed step changes nothing (the same step is tried again), except that a request whose
logits are not numbers finishes alone with finish_reason "error" and the reason in
request.error; abort() finishes the handle; an Engine is safe to call from several threads (one
lock, granted in turn: a step runs whole while a submit or an abort from another thread waits); close() (or a
with block) gives the worker's memory back, and so does dropping the last reference.
"""
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..core import checks
from ..core.checks import INT32_MAX
from .. import _C
from ..core.errors import ArgumentTypeError, InvalidArgumentError, StateError
from ..core.fairlock import FairLock
from ..models.tokenizer import chat_prompts, tokenize_prompt
from ..core.units import format_size, parse_size
from .worker import Worker

# An arrival further ahead of the engine's clock than this is almost surely an absolute time
# (time.time()) where seconds since the engine started were meant; it would never be served.
MAX_ARRIVAL_AHEAD = 3600.0
# memory=None: the whole model and the KV of worker.DEFAULT_KV_TOKENS tokens, and at least this
ENGINE_MEMORY_FLOOR = "256MiB"


LOGPROBS_MAX = 20  # vLLM's cap on logprobs and prompt_logprobs (GY_LOGPROBS_MAX)
MASK64 = 2**64 - 1


def mix_seed(a, b):
    """A 64-bit seed from two 64-bit numbers: splitmix64's finaliser over a + golden * (b + 1),
    so nearby inputs (request 0, 1, 2 of one engine seed) give unrelated streams."""
    z = (a + 0x9E3779B97F4A7C15 * (b + 1)) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability in the raw logits (vLLM's default), its rank (1 = most
    likely) and its text (None without a tokenizer): vLLM's Logprob."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, under vLLM's names. temperature 0 is greedy; top_k
    0 or -1, top_p 1 and min_p 0 are off. Order as vLLM's: penalties and min_tokens, then
    temperature, min_p, top_k, top_p, a draw keyed by (seed, token index), so a request's tokens
    do not depend on its batch or on moves between instances.

    Beside vLLM: temperature defaults to 0.0 (vLLM 1.0). seed None (the default) takes one
    derived from the engine's seed and the request id at submission (Engine(seed=), Host(seed=)),
    so runs repeat and copies of one prompt differ. max_tokens None runs to the model's context
    (its positions minus the prompt). n and best_of describe a request of several samples: an
    engine serves one sample per request, so submit each of sample_params(). logprobs and
    prompt_logprobs (0..20) fill request.logprobs / prompt_logprobs; cumulative_logprob is
    always kept. stop strings need a tokenizer; include_stop_str_in_output keeps them in the
    text, skip_special_tokens=False keeps special tokens' text."""
    max_tokens: int | None = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    stop: tuple = ()  # strings: the text ends before the first of them (needs a tokenizer)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        # the C engine counts tokens and positions in 32 bits: larger values mean nothing
        if self.max_tokens is not None:
            checks.integer("max_tokens", self.max_tokens, lo=1, hi=INT32_MAX)
        checks.number("temperature", self.temperature, lo=0)
        top_k = checks.integer("top_k", self.top_k, lo=-1, hi=INT32_MAX)
        object.__setattr__(self, "top_k", max(top_k, 0))  # -1 (vLLM's off) is 0 here
        checks.number("top_p", self.top_p, lo=0, hi=1, lo_open=True)
        checks.number("min_p", self.min_p, lo=0, hi=1)
        if self.seed is not None:
            checks.integer("seed", self.seed, lo=0, hi=MASK64)
        stops = checks.int_sequence("stop_token_ids", self.stop_token_ids, lo=0, hi=INT32_MAX)
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        checks.boolean("ignore_eos", self.ignore_eos)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise InvalidArgumentError(f"stop={self.stop!r}: expected a non-empty string or a "
                                       f"list of them")
        object.__setattr__(self, "stop", tuple(stop))
        checks.boolean("include_stop_str_in_output", self.include_stop_str_in_output)
        checks.boolean("skip_special_tokens", self.skip_special_tokens)
        checks.integer("n", self.n, lo=1, hi=INT32_MAX)
        if self.best_of is not None:
            checks.integer("best_of", self.best_of, lo=1, hi=INT32_MAX)
            if self.best_of < self.n:
                raise InvalidArgumentError(f"best_of={self.best_of} must be >= n={self.n}")
        checks.integer("min_tokens", self.min_tokens, lo=0, hi=INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidArgumentError(f"min_tokens={self.min_tokens} must be <= "
                                       f"max_tokens={self.max_tokens}")
        checks.number("presence_penalty", self.presence_penalty, lo=-2, hi=2)
        checks.number("frequency_penalty", self.frequency_penalty, lo=-2, hi=2)
        checks.number("repetition_penalty", self.repetition_penalty, lo=0, lo_open=True)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                checks.integer(name, getattr(self, name), lo=0, hi=LOGPROBS_MAX)

    def sample_params(self):
        """The params of each sample of a request with n / best_of: best_of (or n) of them, each
        with n=1 and best_of=None. With a seed, sample i draws from a seed derived from (seed, i)
        (a single sample keeps the seed itself); without, each stays None and the engine derives
        one per submitted request. Pick the best n of best_of by cumulative_logprob."""
        count = self.best_of or self.n
        if count == 1:
            return [replace(self, n=1, best_of=None)]
        return [replace(self, n=1, best_of=None,
                        seed=None if self.seed is None else mix_seed(self.seed, i))
                for i in range(count)]

    def chosen_samples(self, cumulative_logprobs):
        """Indices of the samples a request returns, given each sample's cumulative_logprob (in
        sample_params() order): all of them in order, or with best_of > n the n most likely,
        most likely first."""
        chosen = range(len(cumulative_logprobs))
        if len(chosen) <= self.n:
            return list(chosen)
        return sorted(chosen, key=lambda i: -cumulative_logprobs[i])[:self.n]


def check_one_sample(params):
    """An engine serves one sample per request: n or best_of above 1 is refused by name."""
    if params.n > 1 or (params.best_of or 1) > 1:
        raise InvalidArgumentError(f"n={params.n}, best_of={params.best_of}: an engine serves "
                                   f"one sample per request; submit each of "
                                   f"params.sample_params()")


def resolve_params(params, prompt_len, max_pos, engine_seed, request_id):
    """The params a submitted request runs with, fixed at submission so that they travel with
    it between instances: max_tokens None -> the rest of the model's max_pos positions; seed
    None -> mixed from (engine seed, request id). Raises a gyges.Error for n or best_of > 1."""
    check_one_sample(params)
    changes = {}
    if params.max_tokens is None:
        room = max_pos - prompt_len
        if room < 1:
            raise InvalidArgumentError(f"max_tokens=None: the prompt ({prompt_len} tokens) leaves "
                                       f"no room in the model's {max_pos} positions")
        if params.min_tokens > room:
            raise InvalidArgumentError(f"min_tokens={params.min_tokens} must be <= max_tokens="
                                       f"{room} (the model's {max_pos} positions minus the prompt)")
        changes["max_tokens"] = room
    if params.seed is None:
        changes["seed"] = mix_seed(engine_seed, request_id)
    return replace(params, **changes) if changes else params


def engine_params(params, stops):
    """The dict gyges._C.Engine's add and adopt read (csrc/python/py_engine.c); stops: int32."""
    return {"max_new_tokens": params.max_tokens, "temperature": float(params.temperature),
            "top_k": params.top_k, "top_p": float(params.top_p), "min_p": float(params.min_p),
            "seed": params.seed, "repetition_penalty": float(params.repetition_penalty),
            "frequency_penalty": float(params.frequency_penalty),
            "presence_penalty": float(params.presence_penalty), "min_tokens": params.min_tokens,
            "logprobs": -1 if params.logprobs is None else params.logprobs,
            "prompt_logprobs": -1 if params.prompt_logprobs is None else params.prompt_logprobs,
            "stop_tokens": np.ascontiguousarray(stops, dtype=np.int32)}


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
    """A submitted request: its tokens so far, whether it finished (finish_reason "stop",
    "length", "abort" or "error"; error says why for the last), and its metrics. With a
    tokenizer, `text` is the output so far, decoded piece by piece (never half a character),
    and `stop_reason` the stop string or token that ended it. `params` are the ones it runs
    with (seed and max_tokens fixed at submission: resolve_params).

    Log-probabilities (vLLM's shapes, of the raw logits): cumulative_logprob sums the sampled
    tokens'; logprobs is None unless params.logprobs is set, else one dict per output token,
    {token_id: Logprob} holding the sampled token then the top params.logprobs; prompt_logprobs
    is None unless params.prompt_logprobs is set, else one entry per prompt token, None for the
    first (and for any not computed yet), then {token_id: Logprob} for the prompt token and the
    top k."""

    def __init__(self, request_id, prompt, params, arrival, detokenizer=None, prompt_text=None,
                 tokenizer=None):
        self.id = request_id
        self.prompt = list(prompt)
        self.prompt_text = prompt_text
        self.params = params
        self.output_tokens = []
        self.cumulative_logprob = 0.0
        self.logprobs = None if params.logprobs is None else []
        self.prompt_logprobs = None if params.prompt_logprobs is None else [None] * len(self.prompt)
        self._tokenizer = tokenizer
        self.text = "" if detokenizer is not None else None
        self.finished = False
        self.finish_reason = None
        self.stop_reason = None
        self.error = None
        self.metrics = RequestMetrics(arrival=arrival)
        self._detokenizer = detokenizer

    def _scored(self, token, logprob, rank, top):
        """{token: Logprob} of a scored token then the top ones ((token, logprob), ...)."""
        out = {token: Logprob(logprob, rank, self._decode(token))}
        for j, (t, lp) in enumerate(top):
            if t not in out:
                out[t] = Logprob(lp, j + 1, self._decode(t))
        return out

    def _decode(self, token):
        return None if self._tokenizer is None else self._tokenizer.decode([token], False)

    def _score_prompt(self, pos, logprob, rank, top):
        """Prompt token `pos` given the ones before it (a recomputed prefill scores it again,
        identically: the first stays)."""
        if self.prompt_logprobs is not None and self.prompt_logprobs[pos] is None:
            self.prompt_logprobs[pos] = self._scored(self.prompt[pos], logprob, rank, top)

    def _append(self, token, now, scored=None):
        """A new token, and (logprob, rank, top) when the engine scored it (a moved request's
        replayed tokens carry theirs in the packet); True when a stop string now ends the text
        (the text is cut before it, or after it with include_stop_str_in_output)."""
        self.output_tokens.append(token)
        self.metrics.token_times.append(now)
        if scored is not None:
            logprob, rank, top = scored
            self.cumulative_logprob += logprob
            if self.logprobs is not None:
                self.logprobs.append(self._scored(token, logprob, rank, top))
        if self._detokenizer is None:
            return False
        piece = self._detokenizer.add(token)
        if not piece:
            return False
        self.text += piece
        if not self.params.stop:
            return False
        # only where the new piece can complete a stop string
        start = max(0, len(self.text) - len(piece) - max(map(len, self.params.stop)) + 1)
        hits = [(self.text.find(x, start), x) for x in self.params.stop]
        hits = [(at, x) for at, x in hits if at >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        keep = at + len(stop) if self.params.include_stop_str_in_output else at
        self.text, self.stop_reason = self.text[:keep], stop
        return True

    def _end(self, reason, error, now):
        """It has finished (reason, and why for "error") at time `now`."""
        self.finished, self.finish_reason, self.error = True, reason, error
        if reason == "stop" and self.stop_reason is None and self.output_tokens:
            self.stop_reason = self.output_tokens[-1]  # the stop token, as vLLM reports it
        self.metrics.first_token = (self.metrics.token_times[0] if self.metrics.token_times
                                    else math.nan)
        self.metrics.finish = now

    def __repr__(self):
        state = f"finished ({self.finish_reason})" if self.finished else "running"
        return (f"Request(id={self.id}, prompt={len(self.prompt)} tokens, "
                f"output={len(self.output_tokens)} tokens, {state})")


def new_request(request_id, prompt, params, arrival, tokenizer=None, prompt_text=None):
    """A handle with its detokenizer (when there is a tokenizer) set up after the prompt."""
    detokenizer = (tokenizer.detokenizer(prompt, skip_special_tokens=params.skip_special_tokens)
                   if tokenizer is not None else None)
    return Request(request_id, prompt, params, arrival, detokenizer, prompt_text, tokenizer)


def check_prompt(tokens, vocab):
    """A list, tuple, range or 1-D integer array of token ids in [0, vocab); returns int32.
    Raises ArgumentTypeError (a str, dict, set or bool, float tokens) or InvalidArgumentError
    (empty, out of the vocabulary) naming the problem."""
    if isinstance(tokens, (str, bytes)):
        raise ArgumentTypeError(f"a prompt must be a sequence of token ids, not a "
                                f"{type(tokens).__name__} (this model has no tokenizer: load a "
                                f"real one, e.g. gyges.Model.load('smollm2-135m-instruct'))")
    ids = checks.int_sequence("prompt", tokens)
    if not ids:
        raise InvalidArgumentError("a prompt must have at least one token")
    # in Python ints first: an id of 2**63 or more does not fit the int64 a NumPy check needs
    bad = next((i for i, token in enumerate(ids) if not 0 <= token < vocab), None)
    if bad is not None:
        raise InvalidArgumentError(f"prompt token {ids[bad]} at index {bad} is outside "
                                   f"the vocabulary [0, {vocab})")
    return np.array(ids, dtype=np.int32)


class Clock:
    """Seconds since a start. An engine or a host and its serving loops share one; it refers to
    none of them, so no reference cycle keeps them alive."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self):
        return time.perf_counter() - self.start

    def advance(self, seconds):
        self.start -= seconds


def check_arrival(arrival, now):
    """arrival: None (now) or seconds since the engine started, not hours ahead of its clock."""
    if arrival is None:
        return now
    arrival = checks.number("arrival", arrival)
    if arrival > now + MAX_ARRIVAL_AHEAD:
        raise InvalidArgumentError(
            f"arrival={arrival:.6g} is {arrival - now:.3g} s ahead of the engine's clock "
            f"({now:.3f} s): arrival is seconds since the engine started (engine.now()), not an "
            f"absolute time such as time.time(); pass None for now")
    return arrival


class InstanceLoop:
    """The Python side of one C serving loop (gyges._C.Engine over one or several TP ranks): the
    request handles it serves and their timestamps. Engine has one; a Host has one per instance.
    Its owner serializes the calls (a lock)."""

    def __init__(self, c_engine, config, clock, tokenizer=None, seed=0, max_pos=None):
        self._c = c_engine
        self.config = config
        self.clock = clock
        self.tokenizer = tokenizer
        self.seed = seed  # what requests without a seed take theirs from (resolve_params)
        self.max_pos = max_pos or config.max_position_embeddings
        self.requests = {}

    def add(self, request_id, tokens, params, arrival=None, prompt_text=None):
        """Queues a request of token ids (prompt_text: the text they were encoded from)."""
        if params.stop and self.tokenizer is None:
            raise InvalidArgumentError(f"stop={list(params.stop)!r}: stop strings need a model "
                                       f"with a tokenizer (use stop_token_ids)")
        prompt = check_prompt(tokens, self.config.vocab_size)
        bad = [t for t in params.stop_token_ids if t >= self.config.vocab_size]
        if bad:
            raise InvalidArgumentError(f"stop_token_ids {bad} are outside the vocabulary "
                                       f"[0, {self.config.vocab_size})")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.config.eos_tokens())
        arrival = check_arrival(arrival, self.clock())
        params = resolve_params(params, len(prompt), self.max_pos, self.seed, request_id)
        request = new_request(request_id, prompt.tolist(), params, arrival, self.tokenizer,
                              prompt_text)
        self._c.add(request.id, prompt, engine_params(params, sorted(stops)), arrival)
        self.requests[request.id] = request
        return request

    def unfinished(self):
        return sum(1 for r in self.requests.values() if not r.finished)

    def step(self):
        """One C step; returns the tokens it ran through the model. A failed step raises and
        changes nothing."""
        tokens, finished, batch_tokens, _, prompt = self._c.step(self.clock())
        done = self.clock()
        for rid, pos, (logprob, rank, top) in prompt:
            self.requests[rid]._score_prompt(pos, logprob, rank, top)
        stopped = [rid for rid, token, scored in tokens
                   if self.requests[rid]._append(token, done, scored)]
        for request_id in finished:
            self._finish(request_id, done)
        for request_id in stopped:  # a stop string: the request ends here, as at a stop token
            if request_id in self.requests:
                self._c.abort(request_id)
                self._finish(request_id, done, reason="stop")
        return batch_tokens

    def abort(self, request):
        """Finishes a request this loop serves (reason "abort"); False when it had finished."""
        if request.finished:
            return False
        self._c.abort(request.id)
        self._finish(request.id, self.clock())
        return True

    def _finish(self, request_id, now, reason=None):
        r = self.requests.pop(request_id)
        info = self._c.info(request_id)
        r.metrics.scheduled = info["first_scheduled"]
        r._end(reason or info["finish"], info["error"] or None, now)
        self._c.release(request_id)

    def drop_engine(self):
        """Forgets the C engine (its owner let it go); the handles stay as they are."""
        self._c = None

    def close(self, why):
        """Stops the loop; requests still in it finish with reason "abort" and `why`."""
        now = self.clock()
        for r in list(self.requests.values()):
            r.finished, r.finish_reason, r.error = True, "abort", why
            r.metrics.finish = now
        self.requests.clear()
        self._c = None


class Serving:
    """run() and generate() for anything with submit(), step(), has_unfinished() and a lock."""

    def run(self):
        """Steps until every submitted request has finished."""
        while self.has_unfinished():
            self.step()

    def generate(self, prompts, params=None):
        """Submits every prompt (token ids, or text when the model has a tokenizer), runs to
        completion, returns the request handles in order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        with self._lock:
            requests = [self.submit(p, params) for p in prompts]
            self.run()
        return requests

    def generate_chat(self, messages, params=None):
        """One conversation ([{"role", "content"}, ...]) or a list of them, rendered with the
        model's chat template (the assistant's turn opened) and generated; returns the handles."""
        return self.generate(chat_prompts(getattr(self.model, "tokenizer", None), messages), params)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def check_params(params):
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ArgumentTypeError(f"params must be a gyges.SamplingParams, got "
                                f"{type(params).__name__}")
    return params


class Engine(Serving):
    """Engine(model, memory=None, page_size=None, block_size=16, kv_layout="header",
    weight_dtype=None, threads=2, max_batch_tokens=512, max_running=64, max_prefill_chunk=0,
    max_tp=None, max_pos=None, pad_ffn=True, backend="cpu", device=0, seed=0)

    memory=None sizes the budget from the model: its weights and the KV of 8192 tokens, at least
    256MiB. backend="cuda" serves from GPU `device` with the same loop, scheduler and sampler:
    only the forward pass runs there (page_size then defaults to 2MiB, the driver's granularity).
    Use it in a with block, or call close(), to give its memory back at a known point.
    seed: requests submitted without a seed get one mixed from it and their id (0, 1, ... in
    submission order), so a run repeats and copies of a prompt differ.
    """

    def __init__(self, model, memory=None, page_size=None, block_size=16,
                 kv_layout="header", weight_dtype=None, threads=2, max_batch_tokens=512,
                 max_running=64, max_prefill_chunk=0, max_tp=None, max_pos=None, pad_ffn=True,
                 backend="cpu", device=0, seed=0):
        for name, value in (("block_size", block_size), ("max_batch_tokens", max_batch_tokens),
                            ("max_running", max_running), ("threads", threads)):
            checks.integer(name, value, lo=1, hi=INT32_MAX)
        checks.integer("max_prefill_chunk", max_prefill_chunk, lo=0, hi=INT32_MAX)
        self.seed = checks.integer("seed", seed, lo=0, hi=MASK64)
        self._lock = FairLock()
        self.model = model
        self.worker = Worker(model, memory=memory, page_size=page_size, block_size=block_size,
                             kv_layout=kv_layout, weight_dtype=weight_dtype, max_tp=max_tp,
                             threads=threads, max_pos=max_pos, pad_ffn=pad_ffn,
                             backend=backend, device=device, memory_floor=ENGINE_MEMORY_FLOOR)
        self.clock = Clock()
        self._c = _C.Engine([self.worker.c_model], [self.worker.kv.handle], None, max_batch_tokens,
                            max_running, max_prefill_chunk)
        self._loop = InstanceLoop(self._c, model.config, self.clock,
                                  getattr(model, "tokenizer", None), seed=self.seed,
                                  max_pos=self.worker.max_pos)
        self._next_id = 0
        self.steps = 0
        self.memory_budget = self.worker.arena.stats()["budget_bytes"]

    def __repr__(self):
        if self._c is None:
            return "Engine(closed)"
        where = "" if self.worker.backend == "cpu" else f", backend={self.worker.backend!r}"
        return f"Engine({self.model!r}, memory={format_size(self.memory_budget)!r}{where})"

    # ---- state ----
    @property
    def closed(self):
        return self._c is None

    def _check_open(self):
        if self._c is None:
            raise StateError("the engine is closed")

    @property
    def arena(self):
        self._check_open()
        return self.worker.arena

    @property
    def kv(self):
        self._check_open()
        return self.worker.kv

    @property
    def weights(self):
        self._check_open()
        return self.worker.weights

    def now(self):
        return self.clock()

    def memory(self):
        """Bytes of the worker's budget: in use, by owner, and the KV cache's blocks."""
        with self._lock:
            s = self.arena.stats()
            kv = self.kv.stats()
            return {"budget": s["budget_bytes"], "in_use": s["bytes_in_use"],
                    "peak": s["peak_bytes"], "weights": s["bytes_by_tag"]["weights"],
                    "kv": s["bytes_by_tag"]["kv"], "weight_padding": self.weights.padding_bytes,
                    "kv_blocks": kv["n_blocks"], "kv_free_blocks": kv["free_blocks"],
                    "kv_block_bytes": kv["block_bytes"]}

    def has_unfinished(self):
        with self._lock:
            return self._c is not None and self._loop.unfinished() > 0

    # ---- requests ----
    def submit(self, tokens, params=None, arrival=None):
        """Queues a request and returns its handle. arrival: seconds since the engine started
        (now by default). A bad prompt or parameter raises a gyges.Error naming it, and so does a
        request that could never fit in this worker's memory; nothing is queued then."""
        params = check_params(params)
        tokens, text = tokenize_prompt(tokens, self._loop.tokenizer)
        with self._lock:
            self._check_open()
            request = self._loop.add(self._next_id, tokens, params, arrival, text)
            self._next_id += 1
            return request

    def abort(self, request):
        """Finishes a request of this engine (finish_reason "abort"; its KV is freed). Returns
        False when it had already finished."""
        if not isinstance(request, Request):
            raise ArgumentTypeError(f"request must be a gyges.Request, got "
                                    f"{type(request).__name__}")
        with self._lock:
            self._check_open()
            if not request.finished and self._loop.requests.get(request.id) is not request:
                raise InvalidArgumentError(f"request {request.id} was not submitted to this engine")
            return self._loop.abort(request)

    @property
    def requests(self):
        """{id: Request} of the requests it serves (unfinished)."""
        return self._loop.requests

    def export(self, rid):
        """A request's scheduler record and its KV sequence ({"info", "seqs", ...})."""
        with self._lock:
            self._check_open()
            return self._c.export(rid)

    def kv_sequence(self, request):
        """The KV sequence (of eng.kv) holding the request's tokens, -1 while it has none
        (queued, preempted or finished: a finished request's blocks are free again)."""
        with self._lock:
            self._check_open()
            if request.finished or self._loop.requests.get(request.id) is not request:
                return -1
            return self._c.export(request.id)["seqs"][0]

    def step(self):
        """Runs one engine step; returns the number of tokens it ran through the model."""
        with self._lock:
            self._check_open()
            batch_tokens = self._loop.step()
            if batch_tokens:
                self.steps += 1
            return batch_tokens

    def stats(self):
        with self._lock:
            self._check_open()
            return self._c.stats()

    def close(self):
        """Stops the engine and gives its memory back (once no NumPy view of it is alive).
        Unfinished requests finish with reason "abort". Later calls raise StateError; closing
        twice is harmless."""
        with self._lock:
            if self._c is None:
                return
            self._loop.close("the engine was closed")
            self._c = None
            self.worker = None
