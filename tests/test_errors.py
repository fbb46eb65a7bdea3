"""One error hierarchy: everything gyges raises is a gyges.Error, with the builtin base that
fits (ValueError, TypeError, MemoryError, OSError, ImportError) so ordinary handlers work, and no
class shadows a builtin name."""
import ast
import builtins
import importlib
import inspect
import pkgutil
from pathlib import Path

import numpy as np
import pytest

import gyges
from gyges import _C

PACKAGE = Path(gyges.__file__).parent
BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items()
                      if inspect.isclass(value) and issubclass(value, BaseException)}


def test_exported_classes_derive_from_error_and_shadow_no_builtin():
    for name in gyges.core.errors.__all__:
        cls = getattr(gyges.core.errors, name)
        assert issubclass(cls, gyges.Error), name
        assert name not in BUILTIN_EXCEPTIONS or name == "Error", name
        assert getattr(gyges, name) is cls, f"gyges.{name} is not exported"
    pairs = [(gyges.InvalidArgumentError, ValueError), (gyges.ArgumentTypeError, TypeError),
             (gyges.ArgumentTypeError, gyges.InvalidArgumentError),
             (gyges.OutOfMemoryError, MemoryError), (gyges.SystemCallError, OSError),
             (gyges.FormatError, ValueError), (gyges.DependencyError, ImportError),
             (gyges.DependencyError, gyges.UnavailableError)]
    for cls, base in pairs:
        assert issubclass(cls, base), (cls, base)
    assert not hasattr(gyges.core.errors, "SystemError")


def test_every_module_error_class_is_a_gyges_error():
    found = []
    for info in pkgutil.iter_modules([str(PACKAGE)]):
        module = importlib.import_module(f"gyges.{info.name}")
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and \
                    not issubclass(value, Warning) and value.__module__.startswith("gyges"):
                found.append(value)
                assert issubclass(value, gyges.Error), f"gyges.{info.name}.{name}"
    assert len(found) > 10  # TraceError, TransformError, ConfigError, ...


def test_no_module_raises_a_builtin_exception():
    """The source, read: a `raise ValueError(...)` anywhere in the package fails this (but the
    AttributeError of a module's __getattr__, which Python's attribute protocol asks for)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        protocol = {id(n) for f in ast.walk(tree)
                    if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
                    for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None or id(node) in protocol:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTIN_EXCEPTIONS:
                offenders.append(f"{path.name}:{node.lineno} raises {exc.id}")
    assert not offenders, offenders


def test_the_extension_raises_gyges_errors_for_bad_arguments():
    comm = _C.Comm(2)
    x = np.zeros(4, np.float32)
    with pytest.raises(gyges.ArgumentTypeError, match="host memory"):
        comm.all_reduce(0, 12345, 4)
    with pytest.raises(gyges.InvalidArgumentError, match="needs 32"):
        comm.all_reduce(0, x, 8)
    with pytest.raises(gyges.ArgumentTypeError, match="sizes must be"):
        comm.all_to_all(0, [x, x], 5, [x, x], [0, 0])
    a = gyges.Arena(budget="1MiB", page_size="64KiB")
    with pytest.raises(gyges.Error):
        _C.KVCache(a._c, 99, 1, 1, 8, 4, 4, 0, 1)  # a layout that does not exist


def test_a_missing_package_is_a_dependency_error_saying_how_to_get_it():
    from gyges.core.errors import require
    with pytest.raises(gyges.DependencyError, match="plotting needs the `no-such-pkg` package.*"
                                                    "pip install no-such-pkg"):
        require("no_such_pkg", "plotting", package="no-such-pkg")
    assert require("json", "reading").dumps(1) == "1"


@pytest.fixture(scope="module")
def tiny():
    return gyges.Model.tiny()


@pytest.mark.parametrize("make, match", [
    # each raised OverflowError or ZeroDivisionError before (issue 33)
    (lambda m: gyges.SamplingParams(max_tokens=2**63), "max_tokens must be in"),
    (lambda m: gyges.SamplingParams(top_k=2**70), "top_k must be in"),
    (lambda m: gyges.SamplingParams(stop_token_ids=[2**64]), r"stop_token_ids\[0\] must be in"),
    (lambda m: gyges.Engine(m, page_size="0"), "page_size must be at least 1"),
    (lambda m: gyges.Engine(m, memory="9" * 400 + "TiB"), "more bytes than a 64-bit size"),
    (lambda m: gyges.Engine(m, max_pos=2**70), "max_pos must be in"),
    (lambda m: gyges.Engine(m, max_running=2**63), "max_running must be in"),
    (lambda m: gyges.Engine(m, block_size=2**70), "block_size must be in"),
])
def test_numbers_past_what_the_engine_counts_are_refused_by_name(tiny, make, match):
    with pytest.raises(gyges.InvalidArgumentError, match=match):
        make(tiny)


@pytest.mark.parametrize("token", [2**63, 2**64, -2**63 - 1])
def test_a_prompt_token_past_64_bits_is_outside_the_vocabulary(tiny, token):
    with gyges.Engine(tiny) as e:
        with pytest.raises(gyges.InvalidArgumentError, match=f"prompt token {token} at index 1"):
            e.submit([1, token], gyges.SamplingParams(max_tokens=2))
        assert e.stats()["waiting"] == 0  # refused before anything changed


def test_closed_objects_answer_repr_and_their_queries_say_closed(tiny):
    """Finding (issue 33): a closed Host's layout() returned '' and its n_workers raised
    TypeError; an Engine had no repr."""
    h = gyges.Host(tiny, workers=2, layout="2xTP1")
    assert repr(h) == "Host(workers=2, layout='2xTP1')"
    h.close()
    assert repr(h) == "Host(closed)" and h.closed and h.instances == []
    for query in (h.layout, h.stats, h.memory, lambda: h.n_workers, lambda: h.weights):
        with pytest.raises(gyges.StateError, match="the host is closed"):
            query()
    e = gyges.Engine(tiny)
    assert repr(e).startswith("Engine(Model(llama, layers=4") and "memory='256MiB'" in repr(e)
    e.close()
    assert repr(e) == "Engine(closed)" and e.closed
    for query in (e.stats, e.memory, e.step):
        with pytest.raises(gyges.StateError, match="the engine is closed"):
            query()
    llm = gyges.LLM(tiny)
    assert repr(llm).startswith("LLM(Model(llama") and "Host(workers=1, layout='TP1')" in repr(llm)
    llm.close()
    assert repr(llm).endswith("Host(closed))")
