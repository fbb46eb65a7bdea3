"""`make demo` is part of the test suite: the main job runs to the end and prints its table."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_make_demo_runs_and_prints_the_comparison(tmp_path):
    # The same job on a shorter trace (GYGES_DEMO_QUICK): `make demo` runs the full one. From
    # another directory, into which (not into the repository) it writes its plot.
    env = {**os.environ, "GYGES_DEMO_QUICK": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "gyges.demo"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "Paris" in out and "(the same text as without the merge" in out
    for expected in ("TTFT ms", "TPOT ms", "merged live into TP4", "static 4xTP1", "static 1xTP4", "transformations",
                     "demo finished"):
        assert expected in out, f"{expected!r} missing from the demo's output"
    # one line per layout says what it won in this very table and why
    for run_name in ("gyges", "static 4xTP1", "static 1xTP4"):
        assert any(line.strip().startswith(f"{run_name}: ") for line in out.splitlines()), run_name
    assert "rejected 1 longer request(s)" in out
    assert (tmp_path / "gyges-demo.png").stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "gyges.demo", "--out", str(tmp_path / "nowhere")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "--out" in bad.stderr and "Traceback" not in bad.stderr
