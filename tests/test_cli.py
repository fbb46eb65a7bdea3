"""The `gyges` command line: a mistake in a flag is one line and exit status 2, found before any
model loads; a benchmark against a server that is down or refuses the key says so in one line."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def gyges(*args, timeout=60):
    """(exit status, stderr, seconds) of `python -m gyges ARGS` run from the repository."""
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "gyges", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    return p.returncode, p.stderr, time.monotonic() - start


@pytest.mark.parametrize("args, says", [
    (["--enable-admin"], "--enable-admin needs --api-key"),
    (["--workers", "2", "--layout", "3xTP1"], "--layout: layout '3xTP1' covers"),
    (["--layout", "TP1+banana"], "--layout: layout part 'banana'"),
    (["--memory-per-worker", "lots"], "--memory-per-worker"),
    (["--seed", "-3"], "--seed"),
    (["--workers", "0"], "--workers must be at least 1, got 0"),
    (["--port", "70000"], "--port must be at most 65535"),
], ids=["admin-without-key", "layout-too-wide", "layout-grammar", "memory", "seed", "workers",
        "port"])
def test_a_bad_serve_flag_is_one_line_before_the_model_loads(args, says):
    code, err, seconds = gyges("serve", *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("gyges serve: error: ") and says in err, err
    assert seconds < 20   # (the model load alone takes longer; nothing was loaded)


@pytest.mark.parametrize("args, says, status", [
    (["--max-output", "0"], "--max-output must be at least 1, got 0", 2),
    (["--rate", "0"], "--rate must be > 0, got 0.0", 2),
    (["--max-output", "4"], "cannot reach http://127.0.0.1:9/v1", 1),   # small is fine
], ids=["max-output", "rate", "server-down"])
def test_bench_serve_says_what_is_wrong_in_one_line(args, says, status):
    code, err, _ = gyges("bench", "serve", "--base-url", "http://127.0.0.1:9/v1",
                         "--requests", "2", *args)
    assert code == status
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], err


def test_the_gyges_command_entry_point_resolves():
    """pyproject.toml's `gyges` script names a function that exists (it named gyges.cli:main,
    a module that does not, so an installed `gyges` command could not start)."""
    import importlib
    import tomllib
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["gyges"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
