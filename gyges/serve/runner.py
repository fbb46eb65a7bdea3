"""A Host stepped on a thread of its own, its requests' progress handed to asyncio streams.

The stepping thread owns the host's progress: it steps while any request is unfinished, and
after each step gives every open stream what its request produced since the last time (new text,
new token ids, the finish). Submits, aborts and transformations come from other threads (the
server's executor) and take the host's lock in turn with the steps (Host is thread-safe, its lock
fair), so a transformation happens between two steps and no stream sees anything but the timing.
"""
import asyncio
import logging
import threading
import time

from ..core.errors import Error

log = logging.getLogger(__name__)


class TokenCounts:
    """Tokens a runner's streams have carried, for the server's throughput line: a request's
    prompt once its first token comes (its prefill done), generated tokens as they come. One
    thread writes (the one that updates the streams)."""

    def __init__(self):
        self.prompt = 0
        self.generation = 0


class Stream:
    """One request's progress as events on an asyncio queue: (text, token ids, finish_reason or
    None, the tokens' logprobs entries or None). Text that may still turn out to start a stop
    string is held back until it cannot."""

    def __init__(self, request, loop, counts=None):
        self.request = request
        self.counts = counts
        self.loop = loop
        self.queue = asyncio.Queue()
        self.sent_tokens = 0
        self.sent_chars = 0
        self.closed = False
        self._hold = max(map(len, request.params.stop), default=1) - 1

    def update(self):
        """On the stepping thread: posts what is new; True once the request has finished."""
        r = self.request
        finished = r.finished
        tokens = r.output_tokens[self.sent_tokens:]
        text = r.text or ""
        end = len(text) if finished else max(self.sent_chars, len(text) - self._hold)
        piece = text[self.sent_chars:end]
        if tokens or piece or finished:
            if tokens and self.counts is not None:
                if self.sent_tokens == 0:
                    self.counts.prompt += len(r.prompt)
                self.counts.generation += len(tokens)
            logprobs = (None if r.logprobs is None else
                        r.logprobs[self.sent_tokens:self.sent_tokens + len(tokens)])
            self.sent_tokens += len(tokens)
            self.sent_chars = end
            event = (piece, list(tokens), r.finish_reason if finished else None, logprobs)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        return finished


class HostRunner:

    def __init__(self, host, idle_seconds=0.01, shed_after=3):
        self.host = host
        self.idle_seconds = idle_seconds
        self.shed_after = shed_after
        self._streams = []
        self._streams_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.steps = 0
        self.failed_steps = 0
        self.counts = TokenCounts()
        self.started = time.time()
        self._thread = threading.Thread(target=self._run, name="gyges-host-steps", daemon=True)

    def start(self):
        self._thread.start()
        return self

    # ---- from the server's threads ----
    def submit(self, prompt, params, loop):
        """Queues a request (token ids) and returns its Stream; a gyges.Error if refused."""
        request = self.host.submit(prompt, params)
        stream = Stream(request, loop, self.counts)
        with self._streams_lock:
            self._streams.append(stream)
        self._wake.set()
        return stream

    def abort(self, stream):
        """The client went away: the request finishes ("abort") and its KV is freed."""
        with self._streams_lock:
            if stream in self._streams:
                self._streams.remove(stream)
        stream.closed = True
        if not stream.request.finished:
            self.host.abort(stream.request)

    def close(self):
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    # ---- the stepping thread ----
    def _shed(self, error):
        """Steps keep failing (memory the scheduler cannot see, such as the process's mapping
        limit): the youngest request ends with an error so that the others go on."""
        with self._streams_lock:
            live = [s for s in self._streams if not s.request.finished]
        if not live:
            return
        victim = live[-1]
        try:
            self.host.abort(victim.request)
        except Error:  # pragma: no cover - finished meanwhile
            return
        victim.request.error = f"dropped after {self.shed_after} failed steps: {error}"
        log.error("request %d dropped: %s", victim.request.id, victim.request.error)

    def _run(self):
        failures = 0
        while not self._stop:
            if self.host.has_unfinished():
                try:
                    if self.host.step():
                        self.steps += 1
                    failures = 0
                except Error as e:  # a failed step changed nothing; it is tried again
                    self.failed_steps += 1
                    failures += 1
                    log.warning("a host step failed (%d in a row): %s", failures, str(e))
                    if failures >= self.shed_after:
                        self._shed(e)
                        failures = 0
                    self._wake.wait(self.idle_seconds)
            else:
                self._wake.wait(self.idle_seconds)
                self._wake.clear()
            self._publish()

    def _publish(self):
        with self._streams_lock:
            streams = list(self._streams)
        done = [s for s in streams if s.update()]
        if done:
            with self._streams_lock:
                self._streams = [s for s in self._streams if s not in done]
