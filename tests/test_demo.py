"""`make demo` is part of the test suite: the main job runs to the end and prints its table."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_make_demo_runs_and_prints_the_comparison():
    # The same job on a shorter trace (GYGES_DEMO_QUICK): `make demo` runs the full one.
    env = {**os.environ, "GYGES_DEMO_QUICK": "1"}
    run = subprocess.run([sys.executable, "-m", "gyges.demo"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "Paris" in out and "(the same text as without the merge" in out
    for expected in ("TTFT ms", "TPOT ms", "merged live into TP4", "static 4xTP1", "static 1xTP4", "transformations",
                     "demo finished"):
        assert expected in out, f"{expected!r} missing from the demo's output"
