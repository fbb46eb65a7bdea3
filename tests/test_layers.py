"""The layering is checked, not only drawn: docs/architecture.md writes the order of the C folders
and of the Python subpackages ("Layer order" lines), and this test reads the #include graph of
csrc/ and the imports of gyges/ (module level and inside functions alike) and fails on an arrow
that runs up that order, on an arrow between two folders of one rank (the CPU kernels and their
CUDA twins), or on a cycle between modules. tests/test_layers.py::test_the_check_fails_on_a_bad_arrow
breaks it once on purpose."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


def layer_order(which):
    """The ranks the doc's line `<which> layer order: a < b < {c, d} < ...` gives (lowest 0)."""
    for line in DOC.read_text().splitlines():
        m = re.match(rf"\s*{which} layer order:\s*(.+)$", line)
        if m:
            ranks = {}
            for rank, part in enumerate(m.group(1).strip(". ").split("<")):
                for name in part.strip(" {}").split(","):
                    ranks[name.strip()] = rank
            return ranks
    raise AssertionError(f"docs/architecture.md has no '{which} layer order:' line")


# ---- C: folders of csrc/ and their #includes ----

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def c_arrows(root):
    """{(from folder, to folder)} of csrc/, from every quoted #include of .c/.h/.cu/.cuh."""
    arrows = set()
    for path in root.rglob("*"):
        if path.suffix not in (".c", ".h", ".cu", ".cuh"):
            continue
        folder = path.relative_to(root).parts[0]
        for target in INCLUDE.findall(path.read_text(errors="replace")):
            resolved = (path.parent / target).resolve()
            try:
                to = resolved.relative_to(root.resolve()).parts[0]
            except ValueError:
                continue   # a system or CUDA header
            if to != folder:
                arrows.add((folder, to))
    return arrows


def bad_arrows(arrows, ranks):
    bad = []
    for src, dst in sorted(arrows):
        if src not in ranks or dst not in ranks:
            bad.append((src, dst, "a folder the layer order does not name"))
        elif ranks[dst] >= ranks[src]:
            bad.append((src, dst, "runs up" if ranks[dst] > ranks[src] else "between twins"))
    return bad


def test_csrc_includes_follow_the_layer_order():
    ranks = layer_order("C")
    assert bad_arrows(c_arrows(ROOT / "csrc"), ranks) == []


# ---- Python: subpackages of gyges/ and their imports ----

def module_name(path, root):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def py_imports(root):
    """{module: {modules it imports}} over gyges/, with relative imports resolved and imports
    inside functions counted (a deferred import is still an arrow)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                candidates = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            for c in candidates:
                if c in modules and c != name:
                    deps.add(c)
            if isinstance(node, ast.ImportFrom) and all(
                    f"{target}.{a.name}" in modules or a.name == "_C" for a in node.names):
                deps.discard(target)   # `from pkg import module` depends on the module only
        graph[name] = deps
    return graph


def py_layer(module, ranks):
    """A module's layer: its subpackage of gyges, or "top" for gyges/*.py and gyges itself."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in ranks):
        return parts[1]
    return "top"


def cycles(graph):
    """Every strongly connected set of two or more modules (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_gyges_imports_follow_the_layer_order_and_have_no_cycle():
    ranks = layer_order("Python")
    graph = py_imports(ROOT / "gyges")
    bad = []
    for src, deps in sorted(graph.items()):
        for dst in sorted(deps):
            a, b = py_layer(src, ranks), py_layer(dst, ranks)
            if a != b and (a not in ranks or b not in ranks or ranks[b] > ranks[a]):
                # a package's __init__ may re-export its own modules (gyges.reconfig -> ...)
                if not (src == f"gyges.{b}" and a == b):
                    bad.append((src, dst))
    assert bad == []
    # (a package's __init__ importing its modules is not a cycle between them)
    graph = {m: {d for d in deps if not m.endswith(".__init__")} for m, deps in graph.items()}
    assert cycles({m: {d for d in deps if d.rpartition(".")[0] != m} for m, deps in graph.items()}) == []


def private_reaches(root):
    """Lines reaching into another object's C handle (`x._c`) or an instance's loop (`x.loop`):
    `self._c` is an object's own; `peer._c` (a bare name) only where the module owns a `_c`
    itself (an Arena copying from another Arena); `a.b._c` never."""
    found = []
    for path in root.rglob("*.py"):
        text = path.read_text()
        owner = "self._c = " in text
        for n, line in enumerate(text.splitlines(), 1):
            code = line.split("#")[0]
            for m in re.finditer(r"([\w.\]\)]+)\.(_c\b|loop\.)", code):
                who = m.group(1)
                if who == "self" or (owner and m.group(2) == "_c" and re.fullmatch(r"\w+", who)):
                    continue
                found.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
    return found


def test_the_host_imports_no_reconfiguration_and_no_private_handle_is_reached():
    """host.py steps reconfigurations through their protocol and imports none of them; nothing
    in gyges/ reaches into another class's C handle (`._c`) or an instance's loop (`.loop`)."""
    graph = py_imports(ROOT / "gyges")
    assert not [m for m in graph["gyges.runtime.host"] if m.startswith("gyges.reconfig")]
    assert private_reaches(ROOT / "gyges") == []


def test_the_check_fails_on_a_bad_arrow(tmp_path):
    """Break it once: an include from kv/ up into engine/, one between the twin folders, a
    cycle of two modules: each is found."""
    ranks = layer_order("C")
    (tmp_path / "kv").mkdir()
    (tmp_path / "engine").mkdir()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "engine" / "engine.h").write_text("")
    (tmp_path / "cpu" / "a.h").write_text("")
    (tmp_path / "kv" / "kv.c").write_text('#include "../engine/engine.h"\n')
    (tmp_path / "kernels" / "k.cu").write_text('#include "../cpu/a.h"\n')
    found = bad_arrows(c_arrows(tmp_path), ranks)
    assert ("kv", "engine", "runs up") in found and ("kernels", "cpu", "between twins") in found
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    pkg = tmp_path / "gyges"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "host.py").write_text("def f():\n    from ..reconfig import buddy\n")
    (pkg / "reconfig").mkdir()
    (pkg / "reconfig" / "__init__.py").write_text("")
    (pkg / "reconfig" / "buddy.py").write_text("from ..runtime import host\n")
    graph = py_imports(pkg)
    assert graph["gyges.runtime.host"] == {"gyges.reconfig.buddy"}   # a deferred import counts
    (pkg / "runtime" / "worker.py").write_text("x = kv.cache._c\ny = other.loop.step()\n")
    assert len(private_reaches(pkg)) == 2
    assert cycles(graph) == [["gyges.reconfig.buddy", "gyges.runtime.host"]]


@pytest.mark.parametrize("which", ["C", "Python"])
def test_the_doc_names_every_folder(which):
    ranks = layer_order(which)
    if which == "C":
        folders = {p.name for p in (ROOT / "csrc").iterdir() if p.is_dir()}
    else:
        folders = {p.name for p in (ROOT / "gyges").iterdir()
                   if p.is_dir() and (p / "__init__.py").exists()} | {"top"}
    assert folders <= set(ranks), sorted(folders - set(ranks))
