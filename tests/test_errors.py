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
