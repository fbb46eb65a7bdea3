"""Builds gyges._C: the C11 core in csrc/ and, when nvcc is on the PATH, the CUDA backend; and
gyges._C_test, the entry points that only tests and benchmarks call (csrc/python_test/: the
kernels on NumPy buffers, fault injection, ...), linked against gyges._C so that both share one
core, one set of exception classes and one fault counter.

GYGES_CUDA=0 turns the CUDA part off; GYGES_CUDA_ARCH picks the SM targets (default "90", the
H100/H200); GYGES_NVCC_FLAGS adds nvcc flags (a kernel's tuning macro, say). The CUDA driver is
never linked: csrc/mem/arena_cuda.c loads libcuda.so.1 at run time, and the CUDA runtime is
linked statically, so `import gyges` works on machines with no GPU.
The C files of an extension compile in parallel (GYGES_BUILD_JOBS, default one per core), and an
object newer than its source and every header, built with the same command, is kept.
GYGES_SKIP_EXT=1 builds no extension: the Makefile's editable install, which runs the ones
`make build` put in gyges/.
cuBLAS is not linked either: csrc/kernels/gemm.cu loads libcublas.so at run time.

The CUDA forward pass (csrc/engine/forward_cuda.c) is built with the CUDA backend
(GY_WITH_CUDA_FORWARD); without it, it compiles to entry points that answer "unavailable".
"""
import os
import shutil
import subprocess
import types
from concurrent.futures import ThreadPoolExecutor
from glob import glob
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


TEST_SOURCES = ROOT / "csrc" / "python_test"


def c_sources(test):
    """gyges._C's sources (every .c of csrc/ but the test extension's), or gyges._C_test's."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.c")
                  if (TEST_SOURCES in p.parents) == test)


def cuda_home():
    if os.environ.get("GYGES_CUDA", "1") == "0":
        return None
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    return Path(nvcc).resolve().parent.parent


CUDA_HOME = cuda_home()


CFLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter", "-D_GNU_SOURCE",
          "-fno-strict-aliasing", "-march=native"]


class BuildExtWithCuda(build_ext):
    """Compiles csrc/kernels/*.cu with nvcc into objects linked into gyges._C, and links
    gyges._C_test against gyges._C."""

    def build_extensions(self):
        # in order, never in parallel (-j): gyges._C_test links against gyges._C; the files of
        # one extension compile in parallel instead
        self.parallel = False
        self.compiler.compile = types.MethodType(_compile_parallel, self.compiler)
        super().build_extensions()

    def build_extension(self, ext):
        if ext.name == "gyges._C" and CUDA_HOME is not None:
            objects = self._compile_cuda()
            ext.extra_objects = ext.extra_objects + objects
            ext.depends = ext.depends + objects  # a rebuilt kernel relinks the extension
        if ext.name == "gyges._C_test":
            # The core's symbols come from gyges._C, found beside this library at run time; it is
            # the very _C that `import gyges` loaded (the loader matches the file), not a copy.
            core = Path(self.get_ext_fullpath("gyges._C"))
            ext.library_dirs = ext.library_dirs + [str(core.parent)]
            ext.extra_link_args = ext.extra_link_args + [f"-l:{core.name}", "-Wl,-rpath,$ORIGIN"]
            ext.depends = ext.depends + [str(core)]  # a relinked _C relinks this one
        super().build_extension(ext)

    def _compile_cuda(self):
        archs = os.environ.get("GYGES_CUDA_ARCH", "90").split(",")
        gencode = []
        for arch in archs:
            gencode += ["-gencode", f"arch=compute_{arch},code=[sm_{arch},compute_{arch}]"]
        out_dir = Path(self.build_temp) / "cuda"
        out_dir.mkdir(parents=True, exist_ok=True)
        objects = []
        jobs = []
        extra = os.environ.get("GYGES_NVCC_FLAGS", "").split()  # e.g. -DGY_ATTN_UNROLL=4
        for source in sorted(glob(str(ROOT / "csrc" / "kernels" / "*.cu"))):
            obj = out_dir / (Path(source).stem + ".o")
            cmd = [str(CUDA_HOME / "bin" / "nvcc"), "-c", source, "-o", str(obj), "-O3",
                   "-std=c++17", "-Xcompiler", "-fPIC", "-DGY_WITH_CUDA=1",
                   f'-DGY_CUDA_LIBDIR="{CUDA_HOME / "lib64"}"', "--expt-relaxed-constexpr",
                   *gencode, *extra]
            # the command beside the object: other flags rebuild it too
            stamp = obj.with_suffix(".cmd")
            if (not obj.exists() or obj.stat().st_mtime < self._newest_input(source)
                    or not stamp.exists() or stamp.read_text() != " ".join(cmd)):
                jobs.append((cmd, stamp))
            objects.append(str(obj))
        # nvcc runs one file per process: one per core (a GPU machine's 16 cores build in the time
        # of the slowest kernel)
        def compile_one(job):
            cmd, stamp = job
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd)
            stamp.write_text(" ".join(cmd))

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(compile_one, jobs))
        return objects

    @staticmethod
    def _newest_input(source):
        headers = list((ROOT / "csrc").rglob("*.h")) + list((ROOT / "csrc").rglob("*.cuh"))
        return max([os.path.getmtime(source)] + [os.path.getmtime(h) for h in headers])


def _compile_parallel(self, sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                      extra_preargs=None, extra_postargs=None, depends=None):
    """distutils' CCompiler.compile, one process per core, skipping an object that is newer
    than its source and every header and was built by the same command (a .cmd beside it).
    distutils decides first whether the extension is out of date at all; then it would compile
    every file, one at a time: 77 s for gyges._C on 2 cores after a header change."""
    macros, objects, extra_postargs, pp_opts, build = self._setup_compile(
        output_dir, macros, include_dirs, sources, depends, extra_postargs)
    cc_args = self._get_cc_args(pp_opts, debug, extra_preargs)
    newest_header = max((os.path.getmtime(h) for h in depends or ()), default=0.0)

    def one(obj):
        src, ext = build[obj]
        stamp = Path(obj).with_suffix(".cmd")
        cmd = " ".join([*self.compiler_so, *cc_args, src, *extra_postargs])
        if (os.path.exists(obj) and stamp.exists() and stamp.read_text() == cmd
                and os.path.getmtime(obj) > max(os.path.getmtime(src), newest_header)):
            return
        self._compile(obj, src, ext, cc_args, extra_postargs, pp_opts)
        stamp.write_text(cmd)

    jobs = int(os.environ.get("GYGES_BUILD_JOBS", 0)) or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, objects))
    return objects


def extension(test):
    """gyges._C, or gyges._C_test when `test`."""
    define_macros = []
    include_dirs = [str(ROOT / "csrc")]
    library_dirs, libraries, extra_link_args = [], ["m", "dl", "pthread"], []
    if CUDA_HOME is not None:
        define_macros.append(("GY_WITH_CUDA", "1"))
        define_macros.append(("GY_WITH_CUDA_FORWARD", "1"))
        include_dirs.append(str(CUDA_HOME / "include"))
        lib = CUDA_HOME / "lib64"
        library_dirs.append(str(lib))
        # The static runtime finds the driver itself at run time; no libcudart.so dependency.
        libraries = ["cudart_static", "stdc++", "rt"] + libraries
        extra_link_args.append(f"-Wl,-rpath,{lib}")
    if test:  # its CUDA calls go through gyges._C's wrappers: no CUDA library of its own
        library_dirs, libraries, extra_link_args = [], ["m"], []
    return Extension(
        "gyges._C_test" if test else "gyges._C",
        sources=c_sources(test),
        # every header: a change to one rebuilds the extension (distutils rebuilds everything
        # when any of these is newer than the library)
        depends=sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.h")),
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args=CFLAGS,
        library_dirs=library_dirs,
        libraries=libraries,
        extra_link_args=extra_link_args,
    )


setup(ext_modules=([] if os.environ.get("GYGES_SKIP_EXT") == "1" else
                   [extension(test=False), extension(test=True)]),
      cmdclass={"build_ext": BuildExtWithCuda})
