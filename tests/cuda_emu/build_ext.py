"""Builds gyges with its CUDA backend on the emulated device, for machines without a GPU:

    python tests/cuda_emu/build_ext.py OUT    # OUT/gyges (the package), OUT/lib/libcuda.so.1

Every C file of csrc/ is compiled as setup.py compiles it with CUDA (GY_WITH_CUDA, and the
forward pass, GY_WITH_CUDA_FORWARD), unchanged; what a GPU build gets from nvcc and the CUDA
libraries comes from here instead:
  - the CUDA runtime calls of forward_cuda.c, its kernels and the cuBLAS wrapper: emu.c (naive,
    float64 sums, on host memory);
  - the rest of kernels.h and the communicators' device side (kernels/comm_d2d.h): emu_device.c
    (synchronous streams; so the d2d communicator runs unchanged);
  - the driver arena_cuda.c opens at run time: fake_libcuda.c, built as OUT/lib/libcuda.so.1 (put
    OUT/lib on LD_LIBRARY_PATH), virtual memory management on a memfd.
The Python package is copied beside the extension. `make cudaemu` runs tests/test_cuda_host.py
against it (PYTHONPATH=OUT, GYGES_CUDA_EMULATED=1): the tests that need a GPU run here, on the
emulated device, with everything above the kernels being the code a GPU runs.

Objects are rebuilt only when a source or header is newer; two compilers run at a time.
"""
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EMU = ROOT / "tests" / "cuda_emu"
FLAGS = ["-std=c11", "-O2", "-g", "-fPIC", "-D_GNU_SOURCE", "-Wall", "-Wextra",
         "-Wno-unused-parameter", "-fno-strict-aliasing", "-march=native",
         "-DGY_WITH_CUDA=1", "-DGY_WITH_CUDA_FORWARD=1"]


def cuda_include():
    nvcc = shutil.which("nvcc")
    candidates = ([Path(nvcc).resolve().parent.parent / "include"] if nvcc else []) + [
        Path("/usr/local/cuda/include")]
    for path in candidates:
        if (path / "cuda.h").exists():
            return path
    return None


def compile_one(cc, source, obj, includes, newest_header):
    if obj.exists() and obj.stat().st_mtime >= max(source.stat().st_mtime, newest_header):
        return
    obj.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([cc, *FLAGS, *includes, "-c", str(source), "-o", str(obj)], check=True,
                   cwd=ROOT)


def build(out):
    out = Path(out).resolve()
    cc = shutil.which("cc") or shutil.which("gcc")
    include = cuda_include()
    if cc is None or include is None:
        raise SystemExit("skipped: the emulated CUDA build needs a C compiler and cuda.h "
                         "(the CUDA toolkit's headers)")
    # The emulated runtime header first: forward_cuda.c must find it, not the toolkit's.
    includes = [f"-I{EMU}", f"-I{ROOT / 'csrc'}", f"-I{include}",
                f"-I{sysconfig.get_paths()['include']}"]
    headers = list((ROOT / "csrc").rglob("*.h")) + list(EMU.glob("*.h"))
    newest = max(p.stat().st_mtime for p in headers)
    sources = sorted((ROOT / "csrc").rglob("*.c")) + [EMU / "emu.c", EMU / "emu_device.c"]
    objects = [out / "obj" / (str(s.relative_to(ROOT)).replace("/", "_") + ".o") for s in sources]
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda so: compile_one(cc, so[0], so[1], includes, newest),
                      zip(sources, objects)))
    package = out / "gyges"
    package.mkdir(parents=True, exist_ok=True)
    for py in (ROOT / "gyges").glob("*.py"):
        shutil.copy2(py, package / py.name)
    extension = package / ("_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([cc, "-shared", *map(str, objects), "-o", str(extension), "-lm", "-ldl",
                    "-lpthread"], check=True)
    (out / "lib").mkdir(exist_ok=True)
    subprocess.run([cc, "-std=c11", "-O1", "-g", "-fPIC", "-shared", "-Wall", "-Wextra",
                    f"-I{include}", str(EMU / "fake_libcuda.c"), "-o",
                    str(out / "lib" / "libcuda.so.1"), "-lpthread"], check=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(f"emulated CUDA build of gyges in {build(sys.argv[1])}")
