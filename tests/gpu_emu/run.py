"""Builds (build.py) and runs what tests/gpu_emu/ checks on a machine without a GPU; `make cudaemu`
runs every part. (The communicators' part, `build.py comm`, runs in the main pytest run, from
tests/test_comm_cuda.py.) And runs any script on the emulated machine.

    python tests/gpu_emu/run.py [PART ...] [--out OUT]     # PART: harness, ext, kernels; all
    python tests/gpu_emu/run.py script FILE.py --devices N [--out OUT] [-- ARGS ...]

  harness  forward_cuda.c, the d2d communicator and the device KV moves against the CPU pass
           (harness.c), under ASan+UBSan;
  ext      the extension on an emulated machine of 4 GPUs with NCCL (the pretend libnccl.so.2):
           every tests/test_cuda_*.py, whose GPU tests then run (GYGES_CUDA_EMULATED=1), a file
           a process, GYGES_EMU_JOBS (default 2) at a time;
  kernels  every kernel of csrc/kernels/*.cu on host fibers: tests/test_cuda.py, under ASan+UBSan
           (preloaded), with every grid shrunk to 3 blocks so that grid-stride loops turn.
  script   builds the ext part's extension if needed and runs FILE.py (with ARGS) on an emulated
           machine of N GPUs with separate memory, the pretend driver and NCCL, as the ext tests
           run: `import gyges` there is that build, `gyges.Host(model, workers=N,
           backend="cuda")` puts one worker on each emulated GPU, joined by NCCL. Exits with the
           script's status. The machine's variables (GYGES_EMU_*, below) may be set around it.

The emulated machine's environment (emulated_env): GYGES_CUDA_EMULATED=1, PYTHONPATH=OUT/ext,
LD_LIBRARY_PATH=OUT/lib (the pretend libcuda.so.1), GYGES_NCCL_LIBRARY=OUT/lib/libnccl.so.2,
GYGES_EMU_DEVICES=N; optionally GYGES_EMU_STREAMS=threads (streams overtake one another) and
GYGES_EMU_NCCL_TIMEOUT_S (the pretend NCCL's hang detector, default 60).

Exits with the first failing part's status.
"""
import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
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


def emulated_env(package, devices=None, nccl=None):
    """The environment of a Python process on the emulated machine of `package` (OUT/ext/gyges):
    its build on PYTHONPATH, the pretend driver on LD_LIBRARY_PATH, `devices` GPUs and the
    pretend NCCL when given."""
    lib = package.parent.parent / "lib"
    env = dict(os.environ, PYTHONPATH=str(package.parent), GYGES_CUDA_EMULATED="1",
               LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(lib),
                                                             os.environ.get("LD_LIBRARY_PATH")])))
    if devices is not None:
        env["GYGES_EMU_DEVICES"] = str(devices)
    if nccl is not None:
        env["GYGES_NCCL_LIBRARY"] = str(nccl)
    return env


def pytest(package, tests, env_extra, extra_args=()):
    env = dict(emulated_env(package), **env_extra)
    command = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=12", *tests,
               *extra_args]   # (the slowest tests named: where make test spends its time)
    print(" ".join(command), flush=True)
    return subprocess.call(command, env=env, cwd=ROOT / "tests")


EXT_DEVICES = 4
# ext test files run side by side, each in its own pytest process: an emulated GPU's tests keep
# about one core busy, and this part is most of make test's time.
EXT_JOBS = int(os.environ.get("GYGES_EMU_JOBS", min(2, os.cpu_count() or 1)))
# Seconds each file took here (2 cores, two at a time): the longest start first, so that the
# part ends soonest; a file not listed starts before all of them.
EXT_SECONDS = {"test_cuda_kunserve.py": 300, "test_cuda_host.py": 260, "test_cuda_nccl.py": 250,
               "test_cuda_stagger.py": 90, "test_cuda_flying.py": 66, "test_cuda_engine.py": 53,
               "test_cuda_multi_gpu.py": 34}


def run_files(package, files, env_extra, extra_args, jobs):
    """pytest of each file in a process of its own, `jobs` at a time, the longest first
    (EXT_SECONDS); each file's output printed whole when it ends. Returns 0, or the first
    failing status."""
    env = dict(emulated_env(package), **env_extra)
    queue = sorted(files, key=lambda f: -EXT_SECONDS.get(f, 1e9))
    lock = threading.Lock()
    statuses = []

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                f = queue.pop(0)
            command = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=8",
                       f, *extra_args]
            start = time.monotonic()
            done = subprocess.run(command, env=env, cwd=ROOT / "tests", text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            with lock:
                print(f"== {' '.join(command)}  ({time.monotonic() - start:.0f} s, exit status "
                      f"{done.returncode})\n{done.stdout}", flush=True)
                statuses.append(done.returncode)
    threads = [threading.Thread(target=worker) for _ in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return next((s for s in statuses if s != 0), 0)


def run_ext(out):
    package = build.build_ext(out)
    nccl = package.parent.parent / "lib" / "libnccl.so.2"
    # every CUDA test of a mechanism (test_cuda.py, the kernels', runs in the kernels part);
    # gemm.cu's own refusal messages: the emulated GEMM (naive_kernels.c) has none of its own
    tests = sorted(p.name for p in (ROOT / "tests").glob("test_cuda_*.py"))
    return run_files(package, tests,
                     {"GYGES_NCCL_LIBRARY": str(nccl), "GYGES_EMU_DEVICES": str(EXT_DEVICES)},
                     ["--deselect",
                      "tests/test_cuda_engine.py::test_gemm_refuses_bad_shapes_before_the_device"],
                     EXT_JOBS)


# Runs sys.argv[1] as `python FILE ARGS` would, once the emulated gyges is imported: a script that
# puts the repository first on sys.path (as every benchmark does, to run without an installed
# package), or one run from the repository, then gets the module already loaded, not the
# repository's own build.
SCRIPT_BOOTSTRAP = """\
import os, runpy, sys
del sys.path[0]  # the working directory
import gyges
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_script(package, script, devices, args):
    """FILE.py on the emulated machine of `package` with `devices` GPUs; returns its exit
    status."""
    nccl = package.parent.parent / "lib" / "libnccl.so.2"
    env = emulated_env(package, devices=devices, nccl=nccl)
    return subprocess.call([PYTHON, "-c", SCRIPT_BOOTSTRAP, str(script), *args], env=env)


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


def script_main(argv):
    parser = argparse.ArgumentParser(prog="run.py script",
                                     description="runs FILE.py on an emulated machine of N GPUs")
    parser.add_argument("file")
    parser.add_argument("--devices", type=int, default=1, metavar="N",
                        help="emulated GPUs, 0 to 16 (default 1)")
    parser.add_argument("--out", default=str(ROOT / "build" / "gpu_emu"))
    # Everything after "--" is the script's own, options included.
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not 0 <= args.devices <= 16:
        parser.error(f"--devices {args.devices}: the emulator has 0 to 16 GPUs")
    script = Path(args.file)
    if not script.is_file():
        parser.error(f"{args.file}: no such file")
    why_not = build.check()
    if why_not:
        raise SystemExit(f"cannot build: {why_not}")
    # The build's own output goes to stderr: the script's stdout stays its own.
    with contextlib.redirect_stdout(sys.stderr):
        package = build.build_ext(Path(args.out).resolve())
    raise SystemExit(run_script(package, script.resolve(), args.devices, rest))


def main():
    if sys.argv[1:2] == ["script"]:
        return script_main(sys.argv[2:])
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
