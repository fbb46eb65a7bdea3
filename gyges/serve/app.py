"""The OpenAI-compatible server: FastAPI over a HostRunner.

    GET  /v1/models                 the one model served
    POST /v1/completions            text (or token ids) in, text out; stream=true: server-sent events
    POST /v1/chat/completions       messages through the model's chat template
    GET  /health                    200 once the host serves
    GET  /metrics                   Prometheus text (gyges/serve/prometheus.py)
    POST /admin/transform           {"workers": [0, 1, 2], "tp": 3, "layers_per_step": null}:
                                    a live transformation while streams are open (--enable-admin)
    GET  /admin/layout              the host's layout and stats (--enable-admin)

Security as vLLM's server does it: an API key makes every /v1 endpoint ask for
`Authorization: Bearer <key>` (401 otherwise); /health and /metrics stay open, as vLLM leaves
them, for load balancers and scrapers (protect_metrics=True makes /metrics ask for the key too);
/admin exists only when enabled, and always asks for the key.

Every request gets an answer: a POST body must be `Content-Type: application/json` (415
otherwise), arrive within body_timeout_s (408), and be UTF-8 JSON of at most max_body_bytes
(413) that protocol.parse_body and the field checks accept (400 naming the field); only a bug
of the server's own is a 500. A client that disconnects, streaming or not, aborts its request,
which frees its KV at the next step. Nothing that can wait (the host's lock, tokenizing a
megabyte) runs on the event loop: it runs on the executor's threads, so /health answers during
the longest prefill or transformation.
"""
import asyncio
import hmac
import json
import logging
import time

from ..core.errors import Error, InvalidArgumentError, require
from ..reconfig import TransformError
from . import protocol
from .prometheus import ServerMetrics
from .protocol import APIError

log = logging.getLogger(__name__)


def build_app(runner, model_name, api_key=None, enable_admin=False, max_body_bytes=1 << 20,
              max_tokens_limit=4096, protect_metrics=False, body_timeout_s=30.0):
    fastapi = require("fastapi", "the server")
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    if enable_admin and not api_key:
        raise InvalidArgumentError("enable_admin needs an api_key: /admin endpoints always ask "
                                   "for it")
    if protect_metrics and not api_key:
        raise InvalidArgumentError("protect_metrics needs an api_key")
    host = runner.host
    tokenizer = host.model.tokenizer
    if tokenizer is None:
        raise InvalidArgumentError("the server needs a model with a tokenizer (a GGUF file, an "
                                   "HF directory with tokenizer.json, or a packaged model)")
    config = host.model.config
    metrics = ServerMetrics(model_name)
    app = fastapi.FastAPI(title="gyges", docs_url=None, redoc_url=None, openapi_url=None,
                          redirect_slashes=False)  # /v1/completions/ is a 404, not a 307
    app.add_middleware(ReadBodyFirst, max_body_bytes=max_body_bytes, timeout_s=body_timeout_s)
    app.state.runner, app.state.metrics = runner, metrics

    def error(e):  # ASCII JSON: a message may quote anything the client sent
        return Response(json.dumps(e.body()), status_code=e.status, media_type="application/json")

    async def off_loop(fn, *args):
        """fn(*args) on an executor thread: whatever may wait or take long stays off the loop."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    @app.exception_handler(APIError)
    async def api_error(request, e):
        return error(e)

    @app.exception_handler(fastapi.exceptions.RequestValidationError)
    async def validation_error(request, e):
        return error(APIError(400, "the request does not match the API"))

    @app.exception_handler(404)
    async def not_found(request, e):
        return error(APIError(404, f"no endpoint {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def not_allowed(request, e):
        return error(APIError(405, f"{request.method} is not allowed on {request.url.path}"))

    def check_key(request):
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "a valid API key is needed (Authorization: Bearer <key>)",
                           type_="authentication_error", code="invalid_api_key")

    async def read_json(request):
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise APIError(415, "the request body must be JSON, sent with Content-Type: "
                                "application/json", code="unsupported_media_type")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(413, f"the request body is over {max_body_bytes} bytes")
        async def whole_body():
            body = b""
            async for part in request.stream():
                body += part
                if len(body) > max_body_bytes:
                    raise APIError(413, f"the request body is over {max_body_bytes} bytes")
            return body
        try:  # a client that declares a length and stops sending would hold its handler forever
            body = await asyncio.wait_for(whole_body(), body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {body_timeout_s} s",
                           code="request_timeout") from None
        return await off_loop(protocol.parse_body, body)

    def check_model(body):
        name = body.get("model") if isinstance(body, dict) else None
        if name is not None and name != model_name:
            raise APIError(404, f"the model {protocol.show(name)} does not exist (this server "
                                f"serves {model_name!r})", code="model_not_found", param="model")

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/v1/models")
    async def models(request: fastapi.Request):
        check_key(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": int(runner.started), "owned_by": "gyges",
                                            "max_model_len": config.max_position_embeddings}]}

    def prepare(body, chat):
        """(prompt ids, SamplingParams) of a request body (on an executor thread: a prompt may
        be a megabyte of text to tokenize)."""
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        check_model(body)
        prompt = (protocol.chat_prompt(body, tokenizer) if chat else
                  protocol.completion_prompt(body, tokenizer, config.vocab_size))
        room = config.max_position_embeddings - len(prompt)
        if room < 1:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this model's context is "
                                f"{config.max_position_embeddings}", param="messages" if chat else "prompt")
        default = min(room, max_tokens_limit) if chat else min(16, max_tokens_limit)
        params = protocol.parse_sampling(body, default, max_tokens_limit, chat)
        if len(prompt) + params.max_tokens > config.max_position_embeddings:
            raise APIError(400, f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) "
                                f"is over this model's context of {config.max_position_embeddings}",
                           param="max_tokens")
        return prompt, params

    def submit_samples(prompt, params, loop):
        """A Stream per sample (params.sample_params()); none stays queued if one is refused."""
        streams = []
        try:
            for sample in params.sample_params():
                streams.append(runner.submit(prompt, sample, loop))
        except BaseException:
            for stream in streams:
                runner.abort(stream)
            raise
        return streams

    async def generate(request, chat):
        check_key(request)
        body = await read_json(request)
        prompt, params = await off_loop(prepare, body, chat)
        stream_it, include_usage = protocol.stream_flags(body)
        loop = asyncio.get_running_loop()
        try:
            streams = await off_loop(submit_samples, prompt, params, loop)
        except Error as e:  # too long for any instance, ...
            raise APIError(400, str(e)) from None
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        if stream_it:  # starlette cancels the stream when the client goes: sse's finally aborts
            return StreamingResponse(sse(streams, rid, chat, include_usage, len(prompt),
                                         params.logprobs),
                                     media_type="text/event-stream")
        result = asyncio.ensure_future(asyncio.gather(*(collect(s) for s in streams)))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait((result, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            result.cancel()
            abandon(*streams)
            raise
        finally:
            gone.cancel()
        if not result.done():  # the client went away: nobody reads an answer
            result.cancel()
            abandon(*streams)
            return Response(status_code=499)
        results = result.result()
        for stream in streams:
            metrics.observe(stream.request)
        for stream, (_, _, finish, _) in zip(streams, results):
            if protocol.finish_reason(finish) is None:
                raise APIError(500, f"the request ended with {finish}: {stream.request.error}",
                               type_="server_error")
        chosen = params.chosen_samples([s.request.cumulative_logprob for s in streams])
        choices = [protocol.choice(index, text, finish, chat, protocol.logprobs_of(
                       entries, tokens, params.logprobs, chat))
                   for index, (text, tokens, finish, entries) in
                   enumerate(results[i] for i in chosen)]
        generated = sum(len(tokens) for _, tokens, _, _ in results)  # best_of's too, as OpenAI
        answer = protocol.completion(rid, model_name, choices, len(prompt), generated, chat)
        if params.prompt_logprobs is not None:   # where vLLM puts them; every sample's prompt is one
            scored = protocol.prompt_logprobs_of(streams[0].request.prompt_logprobs)
            for c in answer["choices"] if not chat else [answer]:
                c["prompt_logprobs"] = scored
        return answer

    def abandon(*streams):
        """The client went away: its requests are aborted (their KV freed) on an executor
        thread. Not awaited: the task that would wait is being cancelled, and under anyio every
        await of a cancelled task is cancelled too."""
        for stream in streams:
            future = asyncio.get_running_loop().run_in_executor(None, runner.abort, stream)
            future.add_done_callback(lambda _, s=stream: metrics.observe(s.request))

    async def disconnected(request):
        """Returns once the client has closed its connection: after the body, the only message
        the ASGI receive channel has left to give is http.disconnect."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def collect(stream):
        """(text, token ids, finish, logprobs entries or None) of a whole request."""
        text, tokens, entries = "", [], []
        while True:
            piece, new, finish, logprobs = await stream.queue.get()
            text, tokens = text + piece, tokens + new
            entries = None if logprobs is None else entries + logprobs
            if finish is not None:
                return text, tokens, finish, entries

    async def sse(streams, rid, chat, include_usage, n_prompt, top_k):
        """The samples' events as one stream of chunks, each naming its choice's index."""
        merged = asyncio.Queue()

        async def forward(index, stream):
            while True:
                event = await stream.queue.get()
                merged.put_nowait((index, event))
                if event[2] is not None:
                    return

        tasks = [asyncio.ensure_future(forward(i, s)) for i, s in enumerate(streams)]
        running, n_tokens, offsets = set(range(len(streams))), 0, [0] * len(streams)
        try:
            if chat:  # the assistant's role first, as OpenAI's stream does
                yield _event(protocol.chunk(rid, model_name, [
                    protocol.choice(i, "", None, chat, delta=True, first=True)
                    for i in range(len(streams))], chat))
            while running:
                index, (piece, new, finish, entries) = await merged.get()
                n_tokens += len(new)
                logprobs = protocol.logprobs_of(entries, new, top_k, chat, offsets[index])
                offsets[index] += len(piece)
                if finish is not None:
                    running.discard(index)
                    metrics.observe(streams[index].request)
                    reason = protocol.finish_reason(finish)
                    if reason is None:
                        yield _event(APIError(500, f"the request ended with {finish}: "
                                                   f"{streams[index].request.error}",
                                              "server_error").body())
                        break
                    yield _event(protocol.chunk(rid, model_name, [protocol.choice(
                        index, piece, reason, chat, logprobs, delta=True)], chat))
                elif piece or logprobs:
                    yield _event(protocol.chunk(rid, model_name, [protocol.choice(
                        index, piece, None, chat, logprobs, delta=True)], chat))
            if include_usage and not running:
                yield _event(protocol.chunk(rid, model_name, [], chat,
                                            usage_=protocol.usage(n_prompt, n_tokens)))
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            if running:  # the client went away mid-stream, or a sample failed
                abandon(*(streams[i] for i in running))

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        return await generate(request, chat=True)

    @app.get("/metrics")
    async def prometheus(request: fastapi.Request):
        if protect_metrics:
            check_key(request)
        stats = await off_loop(host.stats)
        memory = await off_loop(host.memory) if hasattr(host, "memory") else None
        return PlainTextResponse(metrics.render(stats, runner.steps, memory),
                                 media_type="text/plain; version=0.0.4")

    if enable_admin:
        @app.post("/admin/transform")
        async def transform(request: fastapi.Request):
            check_key(request)
            body = await read_json(request)
            args = protocol.transform_args(body, host.n_workers, getattr(host, "n_hosts", None))
            started = time.perf_counter()

            def run():  # the host's lock: on an executor thread
                t = host.transform(**args)
                return t.done, host.layout()
            try:
                done, layout_now = await off_loop(run)
            except (TransformError, Error) as e:
                raise APIError(400, str(e)) from None
            log.info("transformation to TP%s of workers %s started", args["tp"], args["workers"])
            return {"layout": layout_now, "done": done, "seconds": time.perf_counter() - started}

        @app.get("/admin/layout")
        async def layout(request: fastapi.Request):
            check_key(request)
            return await off_loop(lambda: {"layout": host.layout(), **host.stats()})

    return app


class ReadBodyFirst:
    """ASGI middleware: what is left of a request's body is read before the answer starts. An
    early answer (401, 404, 405, 415) would otherwise end the connection while the client still
    sends, and the client would see a reset instead of the answer. Only a body of a declared
    length up to DRAIN_FACTOR times max_body_bytes is read (and thrown away), so that a body a
    little too large gets its 413; past that the connection is closed under the client."""

    DRAIN_FACTOR = 8

    def __init__(self, app, max_body_bytes, timeout_s):
        self.app, self.limit, self.timeout_s = app, max_body_bytes * self.DRAIN_FACTOR, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        unread = [declared.isdigit() and 0 < int(declared) <= self.limit]

        async def receive_():
            message = await receive()
            unread[0] = unread[0] and message["type"] == "http.request" and \
                message.get("more_body", False)
            return message

        async def drain():
            while unread[0]:
                await receive_()

        async def send_(message):
            if message["type"] == "http.response.start":
                try:  # a client that stops sending gets its answer anyway, after the timeout
                    await asyncio.wait_for(drain(), self.timeout_s)
                except asyncio.TimeoutError:
                    pass
            await send(message)

        await self.app(scope, receive_, send_)


def _event(obj):
    return f"data: {json.dumps(obj)}\n\n"
