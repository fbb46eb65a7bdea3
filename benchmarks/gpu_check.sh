#!/usr/bin/env bash
# Every GPU check of the CUDA backend in one run, for a session lent a GPU machine for a few
# minutes: build there, the CUDA tests, compute-sanitizer over the kernel tests, the three CUDA
# benchmarks. Each step has its own time limit, so one that hangs still leaves the others' output.
#
#   bash benchmarks/gpu_check.sh [OUTDIR] [STEPS]     STEPS: any of env build test bench memcheck
#
# Logs and the benchmarks' JSON go to OUTDIR (default build/gpu_check). Uses the machine's
# python3 (numpy, pytest and torch preinstalled there); nothing is fetched.
set -u
OUT=${1:-build/gpu_check}
STEPS=${2:-"env build test bench memcheck"}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
has() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME SECONDS CMD...: run with a time limit, log to OUT/NAME.log, report its status
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n 25 "$OUT/$name.log"
}

if has env; then
    nvidia-smi -L; nvcc --version | tail -n 2; $PY --version
    $PY -c 'import numpy, pytest; print("numpy", numpy.__version__, "pytest", pytest.__version__)'
fi
if has build; then
    step build 150 $PY setup.py -q build_ext --inplace -j "$(nproc)"
fi
if has test; then
    step test 180 $PY -m pytest -q -p no:cacheprovider --timeout=120 -rfEs \
        tests/test_cuda.py tests/test_cuda_engine.py tests/test_cuda_host.py tests/test_comm_cuda.py \
        tests/test_cuda_stagger.py
fi
if has bench; then
    step bench_kernels 60 $PY benchmarks/bench_cuda_kernels.py --quick
    step bench_engine 100 $PY benchmarks/bench_cuda_engine.py
    step bench_comm 60 $PY benchmarks/bench_cuda_comm.py --quick
    # PipeLive's re-splits and KunServe's drop and exchange on virtual CUDA workers
    step bench_pipeline 120 $PY benchmarks/bench_pipeline.py --quick --cuda
    step bench_kunserve 60 $PY benchmarks/bench_kunserve.py --cuda
    # Gyges Figures 9-11 on virtual CUDA workers: basic / gyges KV, partial_swap / padded
    # weights, layer-staggered steps with and without overlap
    step bench_transform 120 $PY benchmarks/bench_transform.py --cuda --quick
    cat benchmarks/results/bench_cuda_*.json benchmarks/results/bench_*_cuda.json >"$OUT/bench_cuda.json" 2>/dev/null  # one file back
fi
if has memcheck; then
    # the kernels against their references under memcheck (out-of-bounds and misaligned device
    # accesses, leaks of cudaMalloc'd memory); last, since it is the slowest
    step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
        $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py
fi
exit 0
