"""Shared test set-up: the real traces folder, skipped with a reason when it is absent."""
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"
TRACES = SHARED / "traces"


@pytest.fixture
def traces_dir():
    if not TRACES.is_dir():
        pytest.skip(f"real traces not found at {TRACES} (../shared is absent)")
    return TRACES
