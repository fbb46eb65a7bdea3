"""An OpenAI-compatible server over a gyges Host (FastAPI + uvicorn, as vLLM's).

    python -m gyges serve --model smollm2-135m-instruct --workers 3 --layout 3xTP1 --port 8000

or from Python (a notebook, a test), on a thread of its own:

    server = gyges.serve.Server(host, model_name="smollm2-135m-instruct", port=8000).start()
    server.url            # http://127.0.0.1:8000/v1, for openai.OpenAI(base_url=...)
    server.stop()
    server = gyges.serve.Server(gyges.Cluster(model, hosts=2, ...), model_name=...).start()
"""
import socket
import threading
import time

from ..core.errors import StateError, require
from ..core.logs import uvicorn_config
from .app import build_app
from .cluster_runner import ClusterRunner
from .runner import HostRunner
from .server_logs import AccessLog, StatsLogger

__all__ = ["Server", "build_app", "HostRunner", "ClusterRunner", "free_port"]


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Server:
    """uvicorn serving build_app(HostRunner(host)), or in front of a gyges.Cluster
    build_app(ClusterRunner(cluster)); binds 127.0.0.1 unless told otherwise.

    Logging (gyges/serve/server_logs.py): uvicorn's lines at log_level in gyges' format;
    access_log: a line per request with its duration; log_stats_interval: vLLM's throughput
    line every so many seconds (None: none). The command line turns both on; from Python they
    are off, as is uvicorn below warning."""

    def __init__(self, host, model_name, port=8000, bind="127.0.0.1", api_key=None,
                 enable_admin=False, max_body_bytes=1 << 20, max_tokens_limit=4096,
                 protect_metrics=False, body_timeout_s=30.0, log_level="warning",
                 access_log=False, log_stats_interval=None):
        uvicorn = require("uvicorn", "the server")
        from ..distributed.cluster import Cluster
        self.host = host
        self.runner = ClusterRunner(host) if isinstance(host, Cluster) else HostRunner(host)
        self.app = build_app(self.runner, model_name, api_key=api_key, enable_admin=enable_admin,
                             max_body_bytes=max_body_bytes, max_tokens_limit=max_tokens_limit,
                             protect_metrics=protect_metrics, body_timeout_s=body_timeout_s)
        self.port = free_port(bind) if port == 0 else port
        self.bind = bind
        config = uvicorn.Config(AccessLog(self.app) if access_log else self.app, host=bind,
                                port=self.port, log_level=log_level,
                                log_config=uvicorn_config(log_level), access_log=False,
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = None
        self._stats = StatsLogger(self.runner, log_stats_interval) if log_stats_interval else None

    @property
    def url(self):
        return f"http://{self.bind}:{self.port}/v1"

    def start(self, timeout=30.0):
        """Serves on a background thread; returns once the port accepts connections."""
        self.runner.start()
        if self._stats is not None:
            self._stats.start()
        self._thread = threading.Thread(target=self._server.run, name="gyges-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise StateError(f"the server did not start on {self.bind}:{self.port}")
            time.sleep(0.02)
        return self

    def run(self):
        """Serves on this thread until interrupted (the command line's way)."""
        self.runner.start()
        if self._stats is not None:
            self._stats.start()
        try:
            self._server.run()
        finally:
            if self._stats is not None:
                self._stats.stop()
            self.runner.close()

    def stop(self):
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
        if self._stats is not None:
            self._stats.stop()
        self.runner.close()
