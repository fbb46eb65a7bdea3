"""The server's log lines: one per HTTP request, and vLLM's throughput line every few seconds.

    INFO 11-29 16:20:01 [server_logs.py:44] 127.0.0.1:50312 - "POST /v1/completions HTTP/1.1" 200 41.3 ms
    INFO 11-29 16:20:10 [server_logs.py:96] Avg prompt throughput: 35.2 tokens/s, Avg generation
        throughput: 80.1 tokens/s, Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 3.1%

(on one line). The access line is uvicorn's with the time the answer took (a stream's: until
its last event); uvicorn's own is off, so that no request is logged twice.
"""
import logging
import threading
import time

from ..core.errors import Error

access_log = logging.getLogger("gyges.serve.access")
log = logging.getLogger(__name__)


class AccessLog:
    """ASGI middleware: a line per HTTP request once its answer is over."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = ["-"]   # (no answer started: the client went away first)

        async def send_(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            client = scope.get("client")
            query = scope.get("query_string", b"").decode("latin-1")
            access_log.info('%s - "%s %s%s HTTP/%s" %s %.1f ms',
                            f"{client[0]}:{client[1]}" if client else "-", scope["method"],
                            scope["path"], f"?{query}" if query else "",
                            scope.get("http_version", "1.1"), status[0],
                            (time.perf_counter() - start) * 1e3)


class StatsLogger:
    """vLLM's throughput line every `interval_s` seconds, on a thread of its own: prompt and
    generated tokens per second over the interval (the runner's TokenCounts), requests running
    and waiting, and KV blocks in use over every worker's (the host's stats). An idle interval
    (no token, nothing running or waiting) logs at DEBUG, so an idle server stays quiet."""

    def __init__(self, runner, interval_s):
        self.runner = runner
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gyges-stats-log", daemon=True)
        self._last = None

    def start(self):
        self._mark()
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _mark(self):
        counts = self.runner.counts
        self._last = (time.monotonic(), counts.prompt, counts.generation)

    def _run(self):
        while not self._stop.wait(self.interval_s):
            try:
                self.log_once()
            except Error as e:   # a host closing under us: the next interval tries again
                log.debug("no stats this interval: %s", str(e))

    def log_once(self):
        t0, prompt0, gen0 = self._last
        self._mark()
        t, prompt, gen = self._last
        stats = self.runner.host.stats()
        running = sum(inst["running"] for inst in stats["instances"])
        waiting = sum(inst["waiting"] for inst in stats["instances"])
        used = sum(w["kv_blocks_used"] for w in stats["workers"])
        capacity = sum(w["kv_blocks_capacity"] for w in stats["workers"])
        seconds = max(t - t0, 1e-9)
        busy = prompt > prompt0 or gen > gen0 or running or waiting
        log.log(logging.INFO if busy else logging.DEBUG,
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                (prompt - prompt0) / seconds, (gen - gen0) / seconds, running, waiting,
                100.0 * used / max(capacity, 1))
