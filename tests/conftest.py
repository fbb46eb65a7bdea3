"""Shared test set-up: the real traces folder, skipped with a reason when it is absent; the gyges
logger as each test found it (a CLI run in-process, `gyges bench serve` in a test, configures it
for a terminal: its own handler, no propagation, which later tests' caplog would not see)."""
import logging
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"
TRACES = SHARED / "traces"


@pytest.fixture
def traces_dir():
    if not TRACES.is_dir():
        pytest.skip(f"real traces not found at {TRACES} (../shared is absent)")
    return TRACES


@pytest.fixture(autouse=True)
def gyges_logger_restored():
    logger = logging.getLogger("gyges")
    state = list(logger.handlers), logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = state
