"""Logging and progress (issue 34): gyges' lines and uvicorn's in one format (vLLM's), a line per
HTTP request, the periodic throughput line, --log-level, and progress bars only when asked for
(or on a terminal). Two real servers (`gyges serve`, the packaged model) start side by side."""
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from gyges.core.logs import LINE
from gyges.serve import free_port

ROOT = Path(__file__).resolve().parent.parent
BAR = "Loading GGUF tensors"   # the model's load bar (tqdm's \r-separated updates, not a log line)
STATS = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: "
                   r"([\d.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, "
                   r"KV cache usage: [\d.]+%")


class Served:
    """`python -m gyges serve ARGS` on a free port, its stderr lines collected as they come."""

    def __init__(self, *args):
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "GYGES_LOGGING_LEVEL"}
        self.proc = subprocess.Popen([sys.executable, "-m", "gyges", "serve", "--port",
                                      str(self.port), "--max-tokens-limit", "64", *args],
                                     cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def get(self, path, body=None):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()

    def wait_ready(self, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "\n".join(self.lines)
            try:
                return self.get("/health")
            except OSError:
                time.sleep(0.2)
        pytest.fail(f"the server did not start in {timeout} s:\n" + "\n".join(self.lines))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()   # uvicorn shuts down on SIGTERM
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.lines


@pytest.fixture(scope="module")
def servers():
    """An info server with a throughput line every 0.5 s, and a --log-level warning one (both
    load the model at once: the slow part)."""
    info = Served("--log-stats-interval", "0.5")
    quiet = Served("--log-level", "warning")
    try:
        for s in (info, quiet):
            s.wait_ready()
        yield info, quiet
    finally:
        info.stop()
        quiet.stop()


def completion(server):
    status, body = server.get("/v1/completions", {"prompt": "The capital of France is",
                                                  "max_tokens": 8})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 8


def test_gyges_and_uvicorn_lines_share_one_format_with_access_and_stats_lines(servers):
    info, _ = servers
    completion(info)
    completion(info)
    stats = None
    deadline = time.monotonic() + 10
    while stats is None and time.monotonic() < deadline:   # a line that saw the tokens
        time.sleep(0.2)
        stats = next((m for m in map(STATS.search, list(info.lines))
                      if m and float(m.group(2)) > 0), None)
    lines = [line for line in info.stop() if line.strip() and BAR not in line]
    assert stats is not None, "no throughput line with generated tokens:\n" + "\n".join(lines)
    assert float(stats.group(1)) > 0   # the prompts' tokens too
    assert [line for line in lines if not LINE.match(line)] == []
    said = "\n".join(lines)
    assert re.search(r"\[cli\.py:\d+\] serving smollm2-135m-instruct on http://", said)   # gyges
    assert re.search(r"\[server\.py:\d+\] Uvicorn running on http://", said)             # uvicorn
    assert re.search(r'127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" 200 [\d.]+ ms', said)
    assert re.search(r'"GET /health HTTP/1\.1" 200 [\d.]+ ms', said)


def test_log_level_warning_silences_info_lines(servers):
    _, quiet = servers
    completion(quiet)
    lines = [line for line in quiet.stop() if line.strip()]
    assert lines == [], "\n".join(lines)   # no INFO line, and no load bar below info


@pytest.mark.parametrize("args, env, says", [
    (["--log-level", "loud"], {}, "--log-level 'loud': expected one of debug, info"),
    ([], {"GYGES_LOGGING_LEVEL": "chatty"}, "GYGES_LOGGING_LEVEL='chatty': expected one of"),
    (["--log-stats-interval", "0"], {}, "--log-stats-interval must be > 0"),
], ids=["flag", "env", "interval"])
def test_a_bad_log_flag_is_one_line_before_the_model_loads(args, env, says):
    p = subprocess.run([sys.executable, "-m", "gyges", "serve", *args], cwd=ROOT,
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr


def test_the_library_logs_at_info_until_the_application_configures_logging():
    """import gyges: its records print in the format at INFO; after logging.basicConfig they go
    to the application's handler alone (once, in its format)."""
    code = ("import logging, gyges\n"
            "logging.getLogger('gyges.x').info('first')\n"
            "logging.getLogger('gyges.x').debug('hidden')\n"
            "logging.basicConfig(format='APP %(message)s', level=logging.INFO)\n"
            "logging.getLogger('gyges.x').info('second')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "GYGES_LOGGING_LEVEL"},
                       timeout=60)
    lines = p.stderr.splitlines()
    assert len(lines) == 2 and LINE.match(lines[0]) and lines[0].endswith("first"), p.stderr
    assert lines[1] == "APP second", p.stderr


def test_a_simulation_shows_a_progress_bar_only_when_asked(capsys):
    from gyges import sim, traces
    trace = traces.poisson(2.0, n=40, input_tokens=(100, 800), output_tokens=(8, 64), seed=1)
    sim.run(trace, policy="gyges", gpus_per_host=2)
    assert capsys.readouterr().err == ""
    sim.run(trace, policy="gyges", gpus_per_host=2, progress=True)
    err = capsys.readouterr().err
    assert "sim gyges: 100%" in err and "40/40" in err, err


def test_a_model_load_shows_a_progress_bar_only_when_asked(tmp_path, capsys):
    import gyges
    gyges.Model.tiny().save(tmp_path)
    gyges.Model.load(tmp_path)   # (captured stderr is no terminal: no bar by default)
    assert "Loading safetensors checkpoint shards" not in capsys.readouterr().err
    gyges.Model.load(tmp_path, progress=True)
    assert "Loading safetensors checkpoint shards: 100%" in capsys.readouterr().err


def test_log_records_hold_no_engine_object():
    """A handler that keeps records (pytest's, a MemoryHandler) must not keep a host alive: a
    refused and rolled-back reconfiguration logs strings, never itself or its exception."""
    import logging

    import gyges
    kept = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record)

    logger = logging.getLogger("gyges")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        host = gyges.Host(gyges.Model.tiny(), workers=4, memory_per_worker="48MiB", layout="TP4",
                          weights="replicated")
        params = gyges.SamplingParams(max_tokens=4, ignore_eos=True)
        for i in range(4):
            host.submit([1 + i, 2, 3, 4] * 5, params)
        host.step()
        with gyges.testing.inject("alloc", 1):
            with pytest.raises(gyges.Error):
                host.switch((0, 1, 2, 3), 1, preempt="soft")
        host.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert any("rolled back" in r.getMessage() for r in kept)
    primitive = (str, int, float, bool, type(None), list, tuple, dict)
    heavy = [(r.getMessage(), type(a).__name__) for r in kept for a in (r.args or ())
             if not isinstance(a, primitive)]
    assert not heavy, heavy
