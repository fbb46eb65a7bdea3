"""`python tests/gpu_emu/run.py script FILE.py --devices N [-- ARGS]`: any script on the emulated
machine of N GPUs with the pretend NCCL (tests/gpu_emu/README.md), the way a user without a GPU
tries a multi-GPU experiment. Builds the ext part where `make cudaemu` does (build/gpu_emu;
incremental), so it is quick after that; skipped with the reason where the emulator cannot be
built."""
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "gpu_emu" / "run.py"
_spec = importlib.util.spec_from_file_location("gpu_emu_build", ROOT / "tests/gpu_emu/build.py")
gpu_emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_emu)

WHY_NOT = gpu_emu.check()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"cannot build the emulator: {WHY_NOT}")

SCRIPT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(ROOT)!r})  # as the benchmarks do: the emulated gyges must still win
    import gyges
    from gyges import _C
    n = _C.cuda_device_count()
    print("devices", n, "args", sys.argv[1:], "emulated", "gpu_emu" in gyges.__file__)
    if n >= 2:
        comm = _C.Comm(n, "nccl", list(range(n)))  # one rank per emulated GPU, by NCCL
        print("nccl", comm.devices)
    sys.exit(int(sys.argv[1]))
""")


def run_script(tmp_path, devices, *args):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(RUN), "script", str(script), "--devices",
                           str(devices), "--", *args], capture_output=True, text=True,
                          timeout=1800, cwd=ROOT)  # where the repository's gyges is at hand


def test_a_script_sees_n_gpus_with_nccl_and_its_exit_status_comes_back(tmp_path):
    result = run_script(tmp_path, 3, "7", "--devices", "5")
    assert result.returncode == 7, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    # The build says nothing on stdout: the script's output is its own.
    assert lines == ["devices 3 args ['7', '--devices', '5'] emulated True", "nccl (0, 1, 2)"], (
        result.stdout + result.stderr)


def test_a_machine_without_gpus_and_bad_arguments(tmp_path):
    result = run_script(tmp_path, 0, "0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["devices 0 args ['0'] emulated True"]
    for argv, message in ((["script", str(tmp_path / "missing.py")], "no such file"),
                          (["script", str(RUN), "--devices", "17"], "0 to 16")):
        bad = subprocess.run([sys.executable, str(RUN), *argv], capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
