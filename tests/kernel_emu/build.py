"""Builds gyges._C with the CUDA kernels running on the host emulator (emu.h, emu.cpp), under
AddressSanitizer, and runs tests/test_cuda.py against it: the kernels' indexing, bounds, barriers
and warp collectives checked on a machine without a GPU.

    .venv/bin/python tests/kernel_emu/build.py [OUT_DIR] [-- pytest arguments]

OUT_DIR (default /tmp/gyges_kernel_emu) receives a copy of csrc/ whose kernels include emu.h and
launch through gy_emu_launch, a gyges/ package built from it, and a copy of tests/test_cuda.py;
the tests then run there with libasan preloaded. Only the kernels' tests are meaningful: the CUDA
arena needs the real driver, and timings mean nothing. GY_EMU_MAX_GRID=3 (set here) shrinks every
grid so that the grid-stride loops turn. Not part of `make test` (minutes of fibers); run it after
touching a kernel when no GPU is at hand.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CUDA = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
SAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer",
       "-g", "-O1"]


def split_top_level(text):
    """Splits on the commas outside parentheses and brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    parts.append(current.strip())
    return parts


LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\((.*?)\);", re.S)


def emulate_launches(source):
    def launch(match):
        kernel, config, args = match.group(1), split_top_level(match.group(2)), match.group(3)
        grid, block = config[0], config[1]
        smem = config[2] if len(config) > 2 else "0"
        return (f"gy_emu_launch((unsigned)({grid}), (unsigned)({block}), (size_t)({smem}), "
                f"{kernel}, {args});")
    source = LAUNCH.sub(launch, source)
    return re.sub(r"extern __shared__ (\w+) (\w+)\[\];",
                  r"\1 *\2 = (\1 *)gy_emu_dynamic_smem();", source)


def run(cmd, **kw):
    print(" ".join(str(c) for c in cmd), flush=True)
    subprocess.check_call([str(c) for c in cmd], **kw)


def build(out):
    src = out / "csrc"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(ROOT / "csrc", src)
    kernels = src / "kernels"
    shutil.copy(HERE / "emu.h", kernels / "emu.h")
    common = (kernels / "common.cuh").read_text()
    (kernels / "common.cuh").write_text(common.replace("#include <cuda_runtime.h>", '#include "emu.h"'))
    objects = []
    obj_dir = out / "obj"
    obj_dir.mkdir(parents=True, exist_ok=True)
    cxx = ["g++", "-std=c++17", "-fPIC", "-DGY_WITH_CUDA=1", f"-I{CUDA / 'include'}", *SAN,
           "-Wno-attributes"]
    for cu in sorted(kernels.glob("*.cu")):
        if cu.name == "device.cu":
            continue  # emu.cpp provides the runtime calls
        cpp = cu.with_suffix(".emu.cpp")
        cpp.write_text(emulate_launches(cu.read_text()))
        obj = obj_dir / (cu.stem + ".o")
        run([*cxx, "-c", cpp, "-o", obj])
        objects.append(obj)
    emu_obj = obj_dir / "emu.o"
    shutil.copy(HERE / "emu.cpp", kernels / "emu_runtime.cpp")
    run([*cxx, "-c", kernels / "emu_runtime.cpp", "-o", emu_obj])
    objects.append(emu_obj)
    cc = ["gcc", "-std=c11", "-fPIC", "-D_GNU_SOURCE", "-DGY_WITH_CUDA=1", "-march=native",
          "-fno-strict-aliasing", f"-I{src}", f"-I{CUDA / 'include'}",
          f"-I{sysconfig.get_paths()['include']}", *SAN]
    newest_header = max(h.stat().st_mtime for h in src.rglob("*.h"))
    for c in sorted(src.rglob("*.c")):
        obj = obj_dir / (str(c.relative_to(src)).replace("/", "_")[:-2] + ".o")
        if not obj.exists() or obj.stat().st_mtime < max(c.stat().st_mtime, newest_header):
            run([*cc, "-c", c, "-o", obj])  # copytree kept the sources' times: rebuild what changed
        objects.append(obj)
    pkg = out / "gyges"
    if pkg.exists():
        shutil.rmtree(pkg)
    shutil.copytree(ROOT / "gyges", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    run(["g++", "-shared", *SAN, *objects, "-o", pkg / f"_C{suffix}", "-lm", "-ldl", "-lpthread"])
    tests = out / "tests"
    tests.mkdir(exist_ok=True)
    shutil.copy(ROOT / "tests" / "test_cuda.py", tests / "test_cuda.py")


def main():
    args = sys.argv[1:]
    pytest_args = []
    if "--" in args:
        i = args.index("--")
        args, pytest_args = args[:i], args[i + 1:]
    out = Path(args[0] if args else "/tmp/gyges_kernel_emu").resolve()
    build(out)
    asan = subprocess.check_output(["gcc", "-print-file-name=libasan.so"], text=True).strip()
    ubsan = subprocess.check_output(["gcc", "-print-file-name=libubsan.so"], text=True).strip()
    env = dict(os.environ, LD_PRELOAD=f"{asan} {ubsan}", ASAN_OPTIONS="detect_leaks=0",
               GY_EMU_MAX_GRID=os.environ.get("GY_EMU_MAX_GRID", "3"), PYTHONPATH=str(out))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py",
           "-k", "not cuda_arena", *pytest_args]  # the arena needs the real driver
    print(" ".join(cmd), flush=True)
    sys.exit(subprocess.call(cmd, cwd=out, env=env))


if __name__ == "__main__":
    main()
