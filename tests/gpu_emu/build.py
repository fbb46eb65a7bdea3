"""Builds what tests/gpu_emu/ runs: csrc/ compiled unchanged, with CUDA, against the emulated
device of this folder instead of a GPU, nvcc, cuBLAS and the driver.

    python tests/gpu_emu/build.py harness OUT   # OUT/harness                      (ASan+UBSan)
    python tests/gpu_emu/build.py ext OUT       # OUT/ext/gyges, OUT/lib/{libcuda.so.1,
                                                #   libnccl.so.2, libgy_emu_cudart.so} (-O2)
    python tests/gpu_emu/build.py kernels OUT   # OUT/kernels/gyges, OUT/lib/...    (ASan+UBSan)
    python tests/gpu_emu/build.py comm OUT      # OUT/comm/test_comm_{thread,address}, libnccl

What each is made of (README.md says why):
  harness  forward_cuda.c and the communicators against the CPU pass (harness.c): every C file of
           csrc/ but the extensions', the emulated runtime (runtime.c), the naive kernels
           (naive_kernels.c), and the real device.cu and comm_d2d.cu on kernel_emu.h (serial).
  ext      both extensions (gyges._C and its test hooks, gyges._C_test) on that same device, for
           the Python tests that need a GPU, the pretend driver (libcuda.c) that
           csrc/mem/arena_cuda.c opens at run time and the pretend NCCL (nccl.c) that
           csrc/comm/comm_nccl.c opens; the emulated runtime is a shared library of its own
           (OUT/lib/libgy_emu_cudart.so) that _C and libnccl.so.2 both link, so that they see
           one machine (Python loads _C with RTLD_LOCAL: NCCL could not reach its symbols).
  kernels  both extensions with every real kernel (csrc/kernels/*.cu) running on host fibers
           (kernel_emu.cpp), for tests/test_cuda.py; the pretend driver too.
  comm     test_comm.c: the communicators and comm_d2d.cu on streams that are threads, under
           ThreadSanitizer and under ASan+UBSan, and the pretend NCCL (nccl.c).
A .cu file becomes C++ here: kernel_emu.h replaces the CUDA runtime header and every
`kernel<<<grid, block, smem, stream>>>(args)` becomes a call of gy_emu_launch_kernel.

Objects are rebuilt only when their source or a header is newer; two compilers run at a time.
Needs a C and a C++ compiler and the CUDA toolkit's headers (not a GPU): check() says what lacks.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
KERNELS = CSRC / "kernels"

WARN = ["-Wall", "-Wextra", "-Wno-unused-parameter"]
C_FLAGS = ["-std=c11", "-D_GNU_SOURCE", "-fPIC", "-fno-strict-aliasing", "-march=native", *WARN,
           "-DGY_WITH_CUDA=1", "-DGY_WITH_CUDA_FORWARD=1"]
CXX_FLAGS = ["-std=c++17", "-fPIC", "-DGY_WITH_CUDA=1", "-Wno-attributes"]
# Optimisation and instrumentation of a flavour of objects.
FLAVOURS = {
    "san": ["-g", "-O1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all"],
    "opt": ["-g", "-O2"],
    "thread": ["-g", "-O1", "-fno-omit-frame-pointer", "-fsanitize=thread"],
}
FLAVOURS["address"] = FLAVOURS["san"]
# The kernels unoptimised under the sanitizers: paged_attention_decode.cu's 36 instantiations take
# g++ 47 s at -O1 and 10 s at -O0, and the kernel tests run about as fast either way.
CU_OPT = {"san": ["-O0"], "address": ["-O0"]}
# The arenas of the harness are CPU ones that its forward pass and the device backend of KV moves
# take for CUDA ones (harness.c defines the two replacements).
AS_CUDA = ["-Dgy_arena_backend=emu_arena_backend", "-Dgy_arena_device=emu_arena_device"]
COMM_SOURCES = ["comm/comm.c", "comm/comm_shm.c", "comm/comm_d2d.c", "comm/comm_stream.c",
                "comm/comm_nccl.c", "core/status.c", "core/fault.c"]


def cuda_include():
    """The CUDA toolkit's include folder (cuda.h, cuda_runtime_api.h, cuda_bf16.h), or None."""
    candidates = [Path(os.environ["CUDA_HOME"]) / "include"] if "CUDA_HOME" in os.environ else []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for path in candidates:
        if all((path / h).exists() for h in ("cuda.h", "cuda_runtime_api.h", "cuda_bf16.h")):
            return path
    return None


def tools():
    return shutil.which("cc") or shutil.which("gcc"), shutil.which("c++") or shutil.which("g++")


def check():
    """None when the emulated builds can be made here, else why not."""
    cc, cxx = tools()
    if cc is None or cxx is None:
        return "the emulated CUDA builds need a C and a C++ compiler (cc, c++)"
    if cuda_include() is None:
        return ("the emulated CUDA builds need the CUDA toolkit's headers (cuda.h, "
                "cuda_runtime_api.h, cuda_bf16.h): none under $CUDA_HOME, nvcc's or /usr/local/cuda")
    return None


def includes():
    return [f"-I{HERE}", f"-I{CSRC}", f"-I{cuda_include()}",
            f"-I{sysconfig.get_paths()['include']}"]


def newest_header():
    headers = [*CSRC.rglob("*.h"), *CSRC.rglob("*.cuh"), *HERE.glob("*.h")]
    return max(p.stat().st_mtime for p in headers)


def emulate_launches(source):
    """A .cu file's text as C++ for kernel_emu.h: launches become gy_emu_launch_kernel calls."""
    def launch(match):
        kernel, config, args = match.group(1), split_top_level(match.group(2)), match.group(3)
        grid, block, smem, stream = (config + ["0", "0"])[:4]
        return (f"gy_emu_launch_kernel((unsigned)({grid}), (unsigned)({block}), (size_t)({smem}), "
                f"(cudaStream_t)({stream}), {kernel}, {args});")
    source = LAUNCH.sub(launch, source)
    source = source.replace("#include <cuda_runtime.h>", '#include "kernel_emu.h"')
    return re.sub(r"extern __shared__ (\w+) (\w+)\[\];",
                  r"\1 *\2 = (\1 *)gy_emu_dynamic_smem();", source)


LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\((.*?)\);", re.S)


def split_top_level(text):
    """Splits on the commas outside parentheses and brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += (ch in "([") - (ch in ")]")
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return parts


class Build:
    """Compiles sources into OUT/obj/<flavour>/, each once, only when out of date."""

    def __init__(self, out, flavour, extra_c=()):
        self.out = Path(out).resolve()
        self.flavour = flavour
        self.obj = self.out / "obj" / flavour
        self.cc_path, self.cxx_path = tools()
        self.c_flags = [*C_FLAGS, *FLAVOURS[flavour], *extra_c, *includes()]
        self.cxx_flags = [*CXX_FLAGS, *FLAVOURS[flavour], *includes()]
        self.newest = newest_header()
        self.jobs = []

    def c(self, source, name=None, defines=()):
        source = Path(source)
        name = name or str(source.resolve().relative_to(ROOT)).replace("/", "_")
        return self._add([self.cc_path, *self.c_flags, *defines], source, name)

    def cxx(self, source, name=None, defines=()):
        return self._add([self.cxx_path, *self.cxx_flags, *defines], Path(source), name or Path(source).name)

    def cu(self, stem, defines=()):
        """csrc/kernels/<stem>.cu as C++ on kernel_emu.h (its .cuh headers converted alike)."""
        src = self.out / "cu"
        src.mkdir(parents=True, exist_ok=True)
        for cuh in KERNELS.glob("*.cuh"):
            write_if_changed(src / cuh.name, emulate_launches(cuh.read_text()))
        cpp = src / f"{stem}.cpp"
        write_if_changed(cpp, emulate_launches((KERNELS / f"{stem}.cu").read_text()))
        # -I csrc/kernels: the .cu files' other includes are relative to their own folder
        return self._add([self.cxx_path, *self.cxx_flags, *CU_OPT.get(self.flavour, []),
                          f"-I{KERNELS}", *defines], cpp, f"cu_{stem}")

    def _add(self, command, source, name):
        obj = self.obj / (name + ".o")
        self.jobs.append((command, source, obj))
        return obj

    def compile(self):
        """Compiles what is out of date; returns every object added so far."""
        self.obj.mkdir(parents=True, exist_ok=True)

        def one(job):
            command, source, obj = job
            args = [*map(str, command), "-c", str(source), "-o", str(obj)]
            line = " ".join(args)
            stamp = obj.with_suffix(".cmd")  # the command that made obj: new flags rebuild it
            if (obj.exists() and stamp.exists() and stamp.read_text() == line
                    and obj.stat().st_mtime >= max(source.stat().st_mtime, self.newest)):
                return None
            result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
            if result.returncode != 0:
                return line + "\n" + result.stdout + result.stderr
            stamp.write_text(line)
            return None

        with ThreadPoolExecutor(max_workers=2) as pool:
            failures = [f for f in pool.map(one, self.jobs) if f]
        if failures:
            raise SystemExit("compilation failed:\n" + "\n".join(failures))
        return [obj for _, _, obj in self.jobs]

    def link(self, objects, target, shared=False, extra=()):
        target.parent.mkdir(parents=True, exist_ok=True)
        run([self.cxx_path, *(["-shared"] if shared else []), *FLAVOURS[self.flavour], *map(str, objects),
             "-o", str(target), *extra, "-lm", "-ldl", "-lpthread"])
        return target


def write_if_changed(path, text):
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def run(command):
    subprocess.run(command, check=True, cwd=ROOT)


TEST_EXTENSION = "python_test/"  # gyges._C_test's sources (setup.py)


def csrc(*exclude):
    """The .c files of csrc/ for gyges._C: all but `exclude` and the test extension's."""
    return [p for p in sorted(CSRC.rglob("*.c")) if str(p.relative_to(CSRC)) not in exclude
            and not str(p.relative_to(CSRC)).startswith(TEST_EXTENSION)]


def package(objects, test_objects, b, target, extra=()):
    """The Python package beside its two extensions: gyges._C linked from `objects` (and
    `extra` linker arguments) and gyges._C_test from `test_objects`, against that _C (as
    setup.py links them)."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(ROOT / "gyges", target, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    b.link(objects, target / ("_C" + suffix), shared=True, extra=extra)
    b.link(test_objects, target / ("_C_test" + suffix), shared=True,
           extra=[f"-L{target}", f"-l:_C{suffix}", "-Wl,-rpath,$ORIGIN"])
    return target


def test_extension(b):
    """Compiles gyges._C_test's sources with `b`; returns their objects."""
    objects = [b.c(source) for source in sorted((CSRC / TEST_EXTENSION).glob("*.c"))]
    b.compile()
    return objects


def shared_library(source, target, extra=(), libs=()):
    """A plain shared library of one C file of this folder, rebuilt when the file (or a
    library in `libs`, linked after it) is newer."""
    newest = max([source.stat().st_mtime] + [Path(l).stat().st_mtime for l in libs])
    if not target.exists() or target.stat().st_mtime < newest:
        target.parent.mkdir(parents=True, exist_ok=True)
        run([tools()[0], "-std=c11", "-O1", "-g", "-fPIC", "-shared", *WARN, *extra,
             f"-I{cuda_include()}", str(source), "-o", str(target), *map(str, libs),
             *([f"-Wl,-rpath,{Path(libs[0]).parent}"] if libs else []), "-lpthread"])
    return target


def libcuda(out):
    """The pretend driver, OUT/lib/libcuda.so.1 (put OUT/lib on LD_LIBRARY_PATH)."""
    return shared_library(HERE / "libcuda.c", Path(out).resolve() / "lib" / "libcuda.so.1")


def build_harness(out):
    b = Build(out, "san")
    for source in csrc("engine/forward_cuda.c", "kernels/kv_move_device.c"):
        if not str(source.relative_to(CSRC)).startswith("python/"):
            b.c(source)
    b.c(CSRC / "engine/forward_cuda.c", "harness_forward_cuda", AS_CUDA)
    b.c(CSRC / "kernels/kv_move_device.c", "harness_kv_move_device", AS_CUDA)
    for stem in ("device", "comm_d2d"):
        b.cu(stem)
    b.cxx(HERE / "kernel_emu.cpp", "kernel_emu_serial", ["-DGY_EMU_SERIAL"])
    for piece in ("runtime.c", "naive_kernels.c", "harness.c"):
        b.c(HERE / piece)
    return b.link(b.compile(), Path(out).resolve() / "harness")


def build_ext(out):
    """OUT/ext/gyges on the emulated machine: OUT/lib holds its runtime, driver and NCCL."""
    lib = Path(out).resolve() / "lib"
    runtime = Build(out, "opt")
    runtime.c(HERE / "runtime.c")
    [runtime_obj] = runtime.compile()
    cudart = lib / "libgy_emu_cudart.so"
    if not cudart.exists() or cudart.stat().st_mtime < runtime_obj.stat().st_mtime:
        runtime.link([runtime_obj], cudart, shared=True)
    b = Build(out, "opt")
    for source in csrc():
        b.c(source)
    for stem in ("device", "comm_d2d"):
        b.cu(stem)
    b.cxx(HERE / "kernel_emu.cpp", "kernel_emu_serial", ["-DGY_EMU_SERIAL"])
    b.c(HERE / "naive_kernels.c")
    libcuda(out)
    shared_library(HERE / "nccl.c", lib / "libnccl.so.2", ["-Werror"], [cudart])
    objects = b.compile()
    return package(objects, test_extension(b), b, Path(out).resolve() / "ext" / "gyges",
                   [str(cudart), f"-Wl,-rpath,{lib}"])


def build_kernels(out):
    b = Build(out, "san")
    for source in csrc():
        b.c(source)
    for cu in sorted(KERNELS.glob("*.cu")):
        b.cu(cu.stem)
    b.cxx(HERE / "kernel_emu.cpp")
    b.c(HERE / "runtime.c")
    libcuda(out)
    objects = b.compile()
    return package(objects, test_extension(b), b, Path(out).resolve() / "kernels" / "gyges")


def build_comm(out):
    """OUT/comm/test_comm_<sanitizer> for sanitizer in ("thread", "address"), and
    OUT/comm/libnccl.so.2; returns {"thread": path, "address": path, "nccl": path}."""
    comm = Path(out).resolve() / "comm"
    built = {"nccl": shared_library(HERE / "nccl.c", comm / "libnccl.so.2", ["-Werror"])}
    for sanitizer in ("thread", "address"):
        b = Build(comm, sanitizer, extra_c=["-Werror"])
        for source in COMM_SOURCES:
            b.c(CSRC / source)
        for stem in ("device", "comm_d2d"):
            b.cu(stem)
        b.cxx(HERE / "kernel_emu.cpp", "kernel_emu_serial", ["-DGY_EMU_SERIAL"])
        for source in (HERE / "runtime.c", HERE / "test_comm.c", ROOT / "tests/c/main.c"):
            b.c(source)
        built[sanitizer] = b.link(b.compile(), comm / f"test_comm_{sanitizer}", extra=["-rdynamic"])
    return built


TARGETS = {"harness": build_harness, "ext": build_ext, "kernels": build_kernels,
           "comm": build_comm}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in TARGETS:
        raise SystemExit(__doc__)
    why_not = check()
    if why_not:
        raise SystemExit(f"cannot build: {why_not}")
    print(TARGETS[sys.argv[1]](sys.argv[2]))
