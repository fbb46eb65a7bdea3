"""The two extensions' surfaces: gyges._C exports what the package uses and nothing else; the
entry points only tests and benchmarks call live in gyges._C_test, which is linked against
gyges._C, so it raises the package's own exception classes and its fault hooks reach the core
that gyges._C runs."""
import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

import gyges
from gyges import _C, _C_test, testing

PACKAGE = Path(gyges.__file__).parent
# Exported by gyges._C though the package never names them, and why.
UNNAMED = {"ArenaView": "the type of Arena.view()'s results"}


def public(module):
    return {name for name in dir(module) if not name.startswith("_")}


def names_the_package_takes_from_C():
    """Every `_C.NAME` and `from .._C import NAME` in gyges/, but gyges/testing.py (the test
    hooks, which take theirs from gyges._C_test)."""
    used = set()
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "testing.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "_C":
                used.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "_C":
                used.update(alias.name for alias in node.names)
    return used


def test_C_exports_what_the_package_uses_and_nothing_else():
    used = names_the_package_takes_from_C()
    assert used - public(_C) == set()  # (the package names nothing _C lacks)
    assert public(_C) - used - set(UNNAMED) == set(), "only tests use these: gyges._C_test"


def test_the_test_hooks_are_in_the_test_extension_only():
    assert public(_C) & public(_C_test) == set()
    for prefix in ("kernel_", "fault_", "FAULT_", "DTYPE_"):
        assert not [n for n in public(_C) if n.startswith(prefix)], prefix
        assert [n for n in public(_C_test) if n.startswith(prefix)], prefix
    # the three CUDA questions the package asks stay; the kernels, copies and timings moved
    assert {n for n in public(_C) if n.startswith("cuda_")} == {
        "cuda_device_count", "cuda_device_memory", "cuda_forward_unavailable"}
    assert len([n for n in public(_C_test) if n.startswith("cuda_")]) >= 20
    assert {"sample", "sampler_probs", "rng_uniform", "Scheduler", "sim_step_time",
            "sim_phase_time", "sim_pipeline"} <= public(_C_test)


def test_the_test_extension_raises_the_package_errors():
    # no exception class of its own: every class it raises is gyges._C's
    assert not [v for v in vars(_C_test).values()
                if inspect.isclass(v) and issubclass(v, BaseException)]
    with pytest.raises(gyges.InvalidArgumentError) as bad_value:
        _C_test.fault_arm(-1, 1)
    assert type(bad_value.value) is gyges.InvalidArgumentError is _C.InvalidArgumentError
    with pytest.raises(gyges.ArgumentTypeError) as bad_type:
        _C_test.sample(np.zeros((1, 4), np.float32), 1, 4, 5)
    assert type(bad_type.value) is gyges.ArgumentTypeError
    assert isinstance(bad_type.value, gyges.Error)
    with pytest.raises(gyges.Error):  # UnavailableError, or CudaError from the runtime
        _C_test.cuda_device_info(-1)


def test_a_fault_armed_through_the_test_extension_fails_the_core_of_C():
    """One core in the process: the fault counter _C_test arms is the one _C's arena checks."""
    arena = gyges.Arena(budget="1MiB", page_size="64KiB")
    with testing.inject("page_create", 2) as fired:
        arena.create_page("kv")
        with pytest.raises(gyges.Error):
            arena.create_page("kv")
        assert fired() == 1
    assert testing.count("page_create", lambda: arena.create_page("kv"))[0] == 1
