"""Every Python block of README.md runs, in order, in one namespace, as a reader would paste
them into a notebook. The GPU blocks (backend="cuda", d2d or nccl pools) are skipped with the
reason where no GPU is usable."""
import os
import re
from pathlib import Path

import pytest

from gpu import GPU_SKIP_REASON

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GPU_MARKS = ('backend="cuda"', 'backend="d2d"', 'backend="nccl"')


def blocks():
    text = README.read_text()
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, re.S):
        line = text[:m.start()].count("\n") + 2
        out.append((line, m.group(1)))
    return out


BLOCKS = blocks()
NAMESPACE = {"__name__": "readme"}


def test_the_readme_has_blocks():
    assert len(BLOCKS) >= 10


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code, monkeypatch):
    if any(mark in code for mark in GPU_MARKS) and GPU_SKIP_REASON is not None:
        pytest.skip(f"a GPU block: {GPU_SKIP_REASON}")
    monkeypatch.chdir(ROOT)  # the blocks name ../shared/traces from the repository root
    exec(compile(code, f"{README}:{line}", "exec"), NAMESPACE)


def test_the_namespace_is_released():
    """The blocks' hosts and engines go with their names (no leak between test files)."""
    for value in list(NAMESPACE.values()):
        close = getattr(value, "close", None)
        if callable(close) and type(value).__module__.startswith("gyges"):
            close()
    NAMESPACE.clear()
    assert os.getcwd()
