"""Builds (build.py) and runs what tests/gpu_emu/ checks on a machine without a GPU; `make cudaemu`
runs every part. (The communicators' part, `build.py comm`, runs in the main pytest run, from
tests/test_comm_cuda.py.)

    python tests/gpu_emu/run.py [PART ...] [--out OUT]     # PART: harness, ext, kernels; all

  harness  forward_cuda.c, the d2d communicator and the device KV moves against the CPU pass
           (harness.c), under ASan+UBSan;
  ext      the extension on the emulated device: tests/test_cuda_host.py and test_cuda_engine.py,
           whose GPU tests then run (GYGES_CUDA_EMULATED=1);
  kernels  every kernel of csrc/kernels/*.cu on host fibers: tests/test_cuda.py, under ASan+UBSan
           (preloaded), with every grid shrunk to 3 blocks so that grid-stride loops turn.

Exits with the first failing part's status.
"""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import build

ROOT = build.ROOT
PYTHON = sys.executable


def sanitizer_preload():
    """The ASan and UBSan runtimes, for a Python that loads an instrumented extension."""
    libs = [subprocess.check_output(["gcc", f"-print-file-name={lib}"], text=True).strip()
            for lib in ("libasan.so", "libubsan.so")]
    return " ".join(libs)


def run_harness(out):
    harness = build.build_harness(out)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0")
    return subprocess.call([str(harness)], env=env, cwd=ROOT)


def pytest(package, tests, env_extra, extra_args=()):
    env = dict(os.environ, PYTHONPATH=str(package.parent), GYGES_CUDA_EMULATED="1",
               LD_LIBRARY_PATH=str(package.parent.parent / "lib"), **env_extra)
    command = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, *extra_args]
    print(" ".join(command), flush=True)
    return subprocess.call(command, env=env, cwd=ROOT / "tests")


def run_ext(out):
    package = build.build_ext(out)
    # gemm.cu's own refusal messages: the emulated GEMM (naive_kernels.c) has none of its own
    return pytest(package, ["test_cuda_host.py", "test_cuda_engine.py"],
                  {"GYGES_NCCL_LIBRARY": "/nonexistent"},
                  ["--deselect", "tests/test_cuda_engine.py::test_gemm_refuses_bad_shapes_before_the_device"])


def run_kernels(out):
    package = build.build_kernels(out)
    # pytest captures the tests' stderr, and a sanitizer report ends the process before pytest
    # shows it: the reports go to files, printed here.
    logs = package.parent / "sanitizer"
    for old in logs.parent.glob("sanitizer.*"):
        old.unlink()
    status = pytest(package, ["test_cuda.py"],
                    {"LD_PRELOAD": sanitizer_preload(),
                     "ASAN_OPTIONS": f"detect_leaks=0:log_path={logs}",
                     "UBSAN_OPTIONS": f"print_stacktrace=1:log_path={logs}",
                     "GY_EMU_MAX_GRID": os.environ.get("GY_EMU_MAX_GRID", "3")})
    for report in sorted(logs.parent.glob("sanitizer.*")):
        text = report.read_text()
        # (ASan also writes its warning about the fibers' swapcontext there: not a finding)
        if "SUMMARY:" in text or "runtime error" in text:
            print(f"-- {report}\n{text}", flush=True)
            status = status or 1
    return status


PARTS = {"harness": run_harness, "ext": run_ext, "kernels": run_kernels}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", default=["all"], choices=[*PARTS, "all"])
    parser.add_argument("--out", default=str(ROOT / "build" / "gpu_emu"))
    args = parser.parse_args()
    why_not = build.check()
    if why_not:
        raise SystemExit(f"cannot build: {why_not}")
    parts = list(PARTS) if "all" in args.parts else args.parts
    for part in parts:
        print(f"== gpu_emu {part}", flush=True)
        status = PARTS[part](Path(args.out).resolve())
        if status != 0:
            raise SystemExit(f"gpu_emu {part} failed (exit status {status})")


if __name__ == "__main__":
    main()
