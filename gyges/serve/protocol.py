"""The OpenAI API's requests and responses as gyges sees them: a request body checked field by
field into (prompt tokens, SamplingParams, stream options), OpenAI-style errors, and the
response and chunk objects of /v1/completions and /v1/chat/completions.

Defaults follow the OpenAI API (and vLLM's server): max_tokens 16 for completions and the room
left for chat, temperature 1.0, top_p 1.0, top_k off (a vLLM extension, -1 or 0); a request
without a seed draws its own stream from the server's seed (runs repeat, requests differ). n and
best_of (up to MAX_N samples), logprobs (completions: an int; chat: logprobs + top_logprobs),
vLLM's prompt_logprobs (not streamed),
the three penalties, min_p and min_tokens are the C sampler's; echo, logit_bias, suffix and tools
are refused by name: gyges does not implement them.

Every body the server reads goes through parse_body: UTF-8 JSON (no NaN or Infinity), at most
MAX_DEPTH deep, every string valid Unicode; every integer is bounded here (below 2**63, most far
below) before anything reaches the C layer, so a malformed body or an out-of-range number is a
400 naming the field, never a 500.
"""
import json
import math
import reprlib
import secrets
import time

from ..runtime.engine import SamplingParams
from ..core.checks import INT32_MAX
from ..core.errors import Error, InvalidArgumentError
from ..models.tokenizer import chat_prompts

REFUSED = {"echo": "echo", "logit_bias": "logit_bias", "suffix": "suffix", "tools": "tools",
           "tool_choice": "tools", "functions": "functions", "response_format": "response_format"}
MAX_N = 16                  # samples (n, best_of) one request may ask for
MAX_LOGPROBS = 20           # top log-probabilities per token, as vLLM's default cap
MAX_DEPTH = 32              # JSON nesting a body may have (a chat needs 4)
_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlevel, _short.maxlist, _short.maxdict = 60, 60, 2, 4, 4
KNOWN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
         "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "user",
         "ignore_eos", "min_tokens", "best_of", "logprobs", "top_logprobs", "presence_penalty",
         "frequency_penalty", "repetition_penalty", "min_p", "skip_special_tokens",
         "include_stop_str_in_output", "prompt_logprobs", *REFUSED}


class APIError(Error):
    """An error the server answers with (OpenAI's shape: {"error": {message, type, param, code}})."""

    def __init__(self, status, message, type_="invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


# the json module's hooks: a ValueError (InvalidArgumentError is one) fails the parse
def _no_constant(name):
    raise InvalidArgumentError(f"{name} is not JSON")


def _finite(text):
    value = float(text)
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{text} is out of a double's range")
    return value


def parse_body(data):
    """The JSON value of a request body (bytes); APIError(400) if it is not UTF-8 JSON, nests
    deeper than MAX_DEPTH, holds NaN, Infinity or a float out of range, or a string that is not
    valid Unicode (a lone surrogate, which no tokenizer or response could encode)."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError):  # ValueError: also an integer of over 4300 digits
        raise APIError(400, "the request body is not valid JSON") from None
    todo = [(value, 1)]
    while todo:  # iterative: the depth check must not recurse itself
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels")
            items = item.items() if isinstance(item, dict) else ((None, v) for v in item)
            for key, v in items:
                if key is not None:
                    todo.append((key, depth))
                todo.append((v, depth + 1))
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "the request body has a string that is not valid Unicode "
                                    "(a lone surrogate)") from None
    return value


def show(value):
    """A value in an error message: short, whatever was sent."""
    return _short.repr(value)


def _number(body, name, default, lo=None, hi=None, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise APIError(400, f"{name} must be {'an integer' if integer else 'a number'}, got "
                            f"{show(value)}", param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise APIError(400, f"{name}={show(value)} is out of range [{lo}, {hi}]", param=name)
    return value


def _boolean(body, name, default):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"{name} must be a boolean, got {show(value)}", param=name)
    return value


def _logprobs(body, chat):
    """SamplingParams.logprobs of a body: completions ask with an int (the top-k), chat with
    logprobs: true and top_logprobs: k."""
    if not chat:
        return _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    top = _number(body, "top_logprobs", None, 0, MAX_LOGPROBS, integer=True)
    if not _boolean(body, "logprobs", False):
        if top is not None:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return top or 0


def _prompt_logprobs(body):
    """vLLM's extension: each prompt token's logprob and the top k, in the whole response."""
    k = _number(body, "prompt_logprobs", None, 0, MAX_LOGPROBS, integer=True)
    if k is not None and body.get("stream"):
        raise APIError(400, "prompt_logprobs comes with a whole response, not a stream",
                       param="prompt_logprobs")
    return k


def prompt_logprobs_of(entries):
    """vLLM's prompt_logprobs of a response: None for the first prompt token, then per token
    {token id (a string, as JSON keys are): {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]


def parse_sampling(body, default_max_tokens, max_tokens_limit, chat=False):
    """SamplingParams of a request body; APIError(400) naming the bad or refused field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, what in REFUSED.items():
        if body.get(name) not in (None, False, 0, {}, []):
            raise APIError(400, f"{what} is not supported by gyges", param=name)
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise APIError(400, f"unknown field {show(unknown[0])}", param=unknown[0][:100])
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    best_of = _number(body, "best_of", None, n, MAX_N, integer=True)
    if best_of is not None and best_of > n and body.get("stream"):
        raise APIError(400, "best_of > n cannot stream: the best are known at the end",
                       param="best_of")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = default_max_tokens if max_tokens is None else _number(
        {"max_tokens": max_tokens}, "max_tokens", None, 1, max_tokens_limit, integer=True)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise APIError(400, "top_p must be > 0", param="top_p")
    top_k = _number(body, "top_k", 0, -1, INT32_MAX, integer=True)  # any k >= vocab: all
    seed = _number(body, "seed", None, 0, 2**63 - 1, integer=True)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "stop must be a non-empty string or a list of up to 4 of them",
                       param="stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(400, "ignore_eos must be a boolean", param="ignore_eos")
    penalties = {name: float(_number(body, name, default, lo, hi)) for name, default, lo, hi in
                 (("presence_penalty", 0.0, -2.0, 2.0), ("frequency_penalty", 0.0, -2.0, 2.0),
                  ("repetition_penalty", 1.0, 0.0, 10.0), ("min_p", 0.0, 0.0, 1.0))}
    min_tokens = _number(body, "min_tokens", 0, 0, max_tokens, integer=True)
    try:  # (SamplingParams' own checks name the field too: repetition_penalty 0, ...)
        return SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                              top_k=max(top_k, 0), top_p=float(top_p), seed=seed,
                              stop=tuple(stop), ignore_eos=ignore_eos, n=n, best_of=best_of,
                              logprobs=_logprobs(body, chat), min_tokens=min_tokens,
                              prompt_logprobs=_prompt_logprobs(body),
                              skip_special_tokens=_boolean(body, "skip_special_tokens", True),
                              include_stop_str_in_output=_boolean(
                                  body, "include_stop_str_in_output", False), **penalties)
    except Error as e:
        raise APIError(400, str(e)) from None


def stream_flags(body):
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    return stream, bool(options.get("include_usage", False))


def completion_prompt(body, tokenizer, vocab):
    """Token ids of a completion's prompt: a string, or a list of token ids (one prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
        return prompt
    raise APIError(400, "prompt must be a non-empty string or a list of token ids (one prompt "
                        "per request)", param="prompt")


def chat_prompt(body, tokenizer):
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or \
                not isinstance(m.get("content"), str):
            raise APIError(400, "each message is {'role': 'system'|'user'|'assistant', 'content': "
                                "str}", param="messages")
    try:  # the contents are encoded as plain text: they never make special tokens
        return chat_prompts(tokenizer, [{"role": m["role"], "content": m["content"]}
                                        for m in messages])[0]
    except Error as e:
        raise APIError(400, str(e), param="messages") from None


def transform_args(body, n_workers, n_hosts=None):
    """host.transform's keyword arguments of a POST /admin/transform body, every one bounded;
    in front of a cluster (n_hosts) also `host`, which host transforms (default 0)."""
    keys = {"workers", "tp", "layers_per_step", "method"} | ({"host"} if n_hosts else set())
    shape = ("the body is {'workers': [...], 'tp': k, 'layers_per_step': null or n, 'method': "
             "null or a name" + (", 'host': null or i}" if n_hosts else "}"))
    if not isinstance(body, dict) or "workers" not in body or "tp" not in body or \
            set(body) - keys:
        raise APIError(400, shape)
    workers = body["workers"]
    if not isinstance(workers, list) or not workers or not all(
            isinstance(w, int) and not isinstance(w, bool) and 0 <= w < n_workers for w in workers):
        raise APIError(400, f"workers must be a non-empty list of worker indices in [0, "
                            f"{n_workers})", param="workers")
    args = {"workers": workers, "tp": _number(body, "tp", None, 1, n_workers, integer=True)}
    if body.get("layers_per_step") is not None:
        args["layers_per_step"] = _number(body, "layers_per_step", None, 1, 1 << 16, integer=True)
    if body.get("method") is not None:
        if not isinstance(body["method"], str):
            raise APIError(400, "method must be a string", param="method")
        args["method"] = body["method"]
    if n_hosts and body.get("host") is not None:
        args["host"] = _number(body, "host", None, 0, n_hosts - 1, integer=True)
    return args


def new_id(prefix):
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens, completion_tokens):
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_of(entries, tokens, top_k, chat, text_offset=0):
    """OpenAI's logprobs object of a choice's new tokens: entries holds one {token id: Logprob}
    per token (the sampled one and the top_k, by rank); None when none were asked for."""
    if entries is None:
        return None
    tops = [sorted(entry.values(), key=lambda lp: lp.rank)[:top_k] for entry in entries]
    sampled = [entry[token] for token, entry in zip(tokens, entries)]
    if chat:
        def item(lp):
            text = lp.decoded_token or ""
            return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(lp), "top_logprobs": [item(t) for t in top]}
                            for lp, top in zip(sampled, tops)]}
    offsets, at = [], text_offset
    for lp in sampled:
        offsets.append(at)
        at += len(lp.decoded_token or "")
    return {"tokens": [lp.decoded_token for lp in sampled],
            "token_logprobs": [lp.logprob for lp in sampled],
            "top_logprobs": [{t.decoded_token: t.logprob for t in top} for top in tops],
            "text_offset": offsets}


def choice(index, text, finish, chat, logprobs=None, delta=False, first=False):
    """One choice of a response (delta=False) or of a stream's chunk."""
    if not chat:
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}
    if not delta:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "finish_reason": finish, "logprobs": logprobs}
    content = {"role": "assistant", "content": text} if first else (
        {"content": text} if text or finish is None else {})
    return {"index": index, "delta": content, "finish_reason": finish, "logprobs": logprobs}


def completion(rid, model, choices, prompt_tokens, completion_tokens, chat):
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(rid, model, choices, chat, usage_=None):
    """A stream's chunk of some choices, or (usage_) the final usage chunk with none."""
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        out["choices"], out["usage"] = [], usage_
    return out


def finish_reason(reason):
    """OpenAI's finish reasons: stop (a stop token or string), length; an abort or an engine
    error ends the stream with an error instead."""
    return reason if reason in ("stop", "length") else None
