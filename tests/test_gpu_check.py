"""benchmarks/gpu_check.sh and gpu_report.py without a GPU: one benchmark step of the check on
the emulated GPU of tests/gpu_emu (GPU_CHECK_EMULATED=1, the decode bench on the tiny model's
shapes), its log, its line in steps.tsv and its JSON gathered into gpu_check.json, and the
report's tables from them. What a GPU session spends its few minutes on must not fail on its
plumbing. Skipped where the emulator cannot be built."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_emu_build", ROOT / "tests/gpu_emu/build.py")
gpu_emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_emu)
WHY_NOT = gpu_emu.check()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"cannot build the emulator: {WHY_NOT}")


def test_a_step_of_the_gpu_check_on_the_emulated_gpu_reaches_the_report(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_EMULATED="1",
               GPU_CHECK_ENGINE_MODEL="tiny", GPU_CHECK_SECONDS="600")
    run = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(out), "engine"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "== bench_engine: rc=0" in run.stdout, run.stdout + (out / "bench_engine.log").read_text()
    name, rc, seconds, limit = (out / "steps.tsv").read_text().split("\t")
    assert (name, rc) == ("bench_engine", "0") and 0 <= int(seconds) <= int(limit) <= 100
    engine = json.loads((out / "gpu_check.json").read_text())["bench_cuda_engine_tiny"]
    assert [(r["batch"], r["context"]) for r in engine["rows"]] == [(1, 64), (4, 64)]
    assert all(r["gyges_ms"] > 0 and r["of_datasheet"] is None for r in engine["rows"])
    report = subprocess.run([sys.executable, "benchmarks/gpu_report.py", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    text = report.stdout
    assert "| bench_engine | 0 |" in text and "CUDA tests: not run" in text
    assert "Model: tiny." in text and "| 1 | 64 |" in text and "| 4 | 64 |" in text
    # every other table says it did not run, naming the file that did not come back
    assert text.count("did not come back") == 10, text
