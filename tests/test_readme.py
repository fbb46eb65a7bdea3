"""Every Python block of README.md runs, in order, in one namespace, as a reader would paste
them into a notebook, and every value its comments show is compared: a line `expr  # <a Python
literal>[: prose]` must give that literal (`...` in a list: a prefix). The GPU blocks
(backend="cuda", d2d or nccl pools) are skipped with the reason where no GPU is usable; every
block, run or not, is checked for names nothing defined before it and for rebinding a name that
a later block reads."""
import ast
import builtins
import io
import re
import tokenize
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


def names(code):
    """(names the code binds, names it reads)."""
    bound, read = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound, read


def name_faults(codes):
    """For each block: the names it reads that neither it nor an earlier block binds, and those
    it rebinds that a later block reads without binding (had the block been skipped, those
    would be different there)."""
    scanned = [names(code) for code in codes]
    faults, before = [], set(dir(builtins))
    for i, (bound, read) in enumerate(scanned):
        later = set().union(*(r - b for b, r in scanned[i + 1:]))
        faults.append((sorted(read - bound - before), sorted(bound & before & later)))
        before |= bound
    return faults


def test_the_readme_has_blocks():
    assert len(BLOCKS) >= 10


def shown(comment):
    """The value a comment shows (a Python literal, maybe followed by prose), or None."""
    text = comment.lstrip("#").strip()
    for candidate in [text] + [text.split(sep)[0] for sep in (": ", " (", "  ", " -", ", ")]:
        try:
            return ast.literal_eval(candidate), candidate
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return None


def matches(got, want):
    """want == got, where a list ending in ... matches any list it begins."""
    if isinstance(want, tuple) and isinstance(got, tuple) and len(want) == len(got):
        return all(matches(g, w) for g, w in zip(got, want))
    if isinstance(want, list) and want and want[-1] is Ellipsis:
        return list(got[:len(want) - 1]) == want[:-1]
    return got == want


def with_checks(code):
    """The block with every `expr  # literal` statement wrapped in a check (__shown)."""
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            value = shown(tok.string)
            if value is not None:
                comments[tok.start[0]] = value[1]
    lines = code.splitlines()
    last = {}
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Expr) and node.end_lineno in comments:
            if node.lineno == node.end_lineno:
                last[node.end_lineno] = max(last.get(node.end_lineno, node), node,
                                            key=lambda n: n.col_offset)
    for n, node in last.items():
        line = lines[n - 1]
        expr = line[node.col_offset:node.end_col_offset]
        lines[n - 1] = (line[:node.col_offset] + f"__shown(({expr}), ({comments[n]}), {n})"
                        + line[node.end_col_offset:])
    return "\n".join(lines) + "\n", len(last)


def _shown(got, want, line):
    assert matches(got, want), f"README block line {line}: the comment shows {want!r}, got {got!r}"


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code, monkeypatch):
    undefined, rebound = name_faults([c for _, c in BLOCKS])[BLOCKS.index((line, code))]
    assert not undefined, f"README block line {line} reads names never defined: {undefined}"
    gpu = any(mark in code for mark in GPU_MARKS)
    # a block that runs only on a GPU must leave what later blocks read as it was (an import
    # binds the same module again)
    rebound = [n for n in rebound if n not in _imported(code)]
    assert not (gpu and rebound), f"README GPU block line {line} rebinds {rebound}, which " \
                                  f"later blocks read"
    if gpu and GPU_SKIP_REASON is not None:
        pytest.skip(f"a GPU block: {GPU_SKIP_REASON}")
    monkeypatch.chdir(ROOT)  # the blocks name ../shared/traces from the repository root
    checked, _ = with_checks(code)
    NAMESPACE["__shown"] = _shown
    exec(compile(checked, f"{README}:{line}", "exec"), NAMESPACE)


def _imported(code):
    return [n for node in ast.walk(ast.parse(code)) if isinstance(node, ast.alias)
            for n in [(node.asname or node.name).split(".")[0]]]


def test_the_name_check_sees_undefined_and_rebound_names():
    """The faults the communicators block once had: names from nowhere, a model rebound."""
    codes = ["m = 1\n", "c, m = 2, 3\nc.f(rank, n)\n", "print(m)\n"]
    assert name_faults(codes) == [([], []), (["n", "rank"], ["m"]), ([], [])]


def test_the_values_the_readme_shows_are_checked():
    """The check sees the README's values, and fails on a wrong one."""
    assert sum(with_checks(code)[1] for _, code in BLOCKS) >= 8
    checked, n = with_checks("x = [3, 4, 5]\nx  # [3, 4, ...]\nlen(x)  # 3: three\n")
    namespace = {"__shown": _shown}
    exec(checked, namespace)
    assert n == 2
    with pytest.raises(AssertionError, match="shows 4, got 3"):
        exec(with_checks("len([1, 2, 3])  # 4\n")[0], namespace)


def test_the_namespace_is_released():
    """The blocks' hosts and engines go with their names (no leak between test files)."""
    closed = 0
    for value in list(NAMESPACE.values()):
        close = getattr(value, "close", None)
        if callable(close) and type(value).__module__.startswith("gyges"):
            close()
            closed += 1
            assert getattr(value, "closed", True), value
    NAMESPACE.clear()
    assert closed > 0
