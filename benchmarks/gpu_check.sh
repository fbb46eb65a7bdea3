#!/usr/bin/env bash
# Every GPU check of the CUDA backend in one run of at most 9 minutes, for a session lent one
# GPU for about 15 minutes in all (a machine's start included): build there, every CUDA test one
# GPU can run (virtual workers for the multi-worker cases; the multi-GPU ones skip with their
# reason), the benchmarks, and compute-sanitizer over the kernel tests. Each step has its own
# time limit, cut to what is left of TOTAL seconds, so one that hangs still leaves the others'
# output. An H200 took 58 s to build and 22 s for the tests (2026-11-25, 661 tests).
#
#   bash benchmarks/gpu_check.sh [OUTDIR] [STEPS]
#        STEPS: any of env build test kernels engine transform pipeline flying kunserve
#               memcheck (default: all)
#
# On a lent machine: the device tool's run with `bash benchmarks/gpu_check.sh $OUT` and a
# timeout_s of 570 (everything it leaves under $OUT comes back, a step cut short included);
# then, here, `python benchmarks/gpu_report.py <files_at>`, the fixes, and a second run of the
# failing steps only (STEPS, with build first: a machine idle for 30 s is given back, and a
# fresh one has no build).
#
# What it prints (and OUTDIR/gpu_check.json holds, one file with every benchmark's JSON):
#   kernels    VMM page create / map / set-access / unmap per 2 MiB page beside kvcached's A100
#              figures (193 / 1.45 / 36 / 25.6 us), and paged-attention decode bandwidth as a
#              fraction of the device's copy bandwidth (bench_cuda_kernels.py);
#   engine     decode tok/s at batch 1 and 32 of a random Llama-3-8B-shaped model in bf16, with
#              the fraction of the copy bandwidth (HBM roofline) it reaches, and PyTorch eager
#              beside it when torch is there (bench_cuda_engine.py --model llama3-8b);
#   transform  the Figure 9/10/11 analogues on virtual CUDA workers against their baselines
#              (bench_transform.py --cuda --quick: basic vs gyges KV, partial_swap vs padding,
#              staggered and overlapped vs stop_world);
#   pipeline   PipeLive's stop and migration time against the layers moved, per mode, on two
#              virtual CUDA workers (bench_pipeline.py --quick --cuda; Fig. 13: ~10 ms live);
#   flying     Flying Serving's bind and release of four virtual CUDA workers at 0/50/90% KV in
#              use, beside a cold TP4 start and a Gyges 4xTP1->TP4 (bench_flying.py --quick
#              --cuda; Table 2: 15 ms);
#   kunserve   KunServe's drop and KV exchange on virtual CUDA workers (bench_kunserve.py --cuda).
# Dry run without a GPU: every benchmark step runs on the emulated GPU of tests/gpu_emu with
# GPU_CHECK_EMULATED=1 (slow, and its timings mean nothing; build and tests are `make`'s there),
# GPU_CHECK_ENGINE_MODEL=tiny for a decode the emulator can run (tests/test_gpu_check.py).
# Logs go to OUTDIR (default build/gpu_check); `python benchmarks/gpu_report.py OUTDIR` turns
# them into the tables of a closing note, each figure beside its anchor. Uses the machine's
# python3 (numpy, pytest and torch preinstalled there); nothing is fetched.
set -u
OUT=${1:-build/gpu_check}
STEPS=${2:-"env build test kernels engine transform pipeline flying kunserve memcheck"}
PY=${PYTHON:-python3}
TOTAL=${GPU_CHECK_SECONDS:-530}
ENGINE_MODEL=${GPU_CHECK_ENGINE_MODEL:-llama3-8b}  # its shapes; batches 1 and 32 at 1K context
# a benchmark runs as `$BENCH FILE $ARGS ARGS...`: on the GPU, or on the emulated one
BENCH=$PY ARGS=
if [[ -n "${GPU_CHECK_EMULATED:-}" ]]; then
    BENCH="$PY tests/gpu_emu/run.py script" ARGS=--
fi
mkdir -p "$OUT"
rm -f "$OUT/steps.tsv"  # name, exit status, seconds, limit: one line a step (gpu_report.py)
export PYTHONUNBUFFERED=1
has() { [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME SECONDS CMD...: run with a time limit, log to OUT/NAME.log, report its status
    local name=$1 limit=$2; shift 2
    local left=$((TOTAL - SECONDS))
    if ((left < 10)); then
        echo "== $name: not run (the ${TOTAL} s are spent)"
        printf '%s\tnot run\t0\t0\n' "$name" >>"$OUT/steps.tsv"
        return
    fi
    ((limit > left)) && limit=$left
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >>"$OUT/steps.tsv"
    tail -n 30 "$OUT/$name.log"
}

rm -f benchmarks/results/bench_cuda_*.json benchmarks/results/bench_*_cuda.json
if has env; then
    nvidia-smi -L; nvcc --version | tail -n 2; $PY --version
    $PY -c 'import numpy, pytest; print("numpy", numpy.__version__, "pytest", pytest.__version__)'
fi
if has build; then
    step build 140 $PY setup.py -q build_ext --inplace -j "$(nproc)"
fi
if has test; then
    # every failure, not the first only: a first run on a new machine is for finding them all
    step test 150 $PY -m pytest -q -p no:cacheprovider --timeout=100 -rfEs --maxfail=30 \
        tests/test_cuda*.py tests/test_comm_cuda.py
fi
if has kernels; then
    step bench_kernels 45 $BENCH benchmarks/bench_cuda_kernels.py $ARGS --quick
fi
if has engine; then
    step bench_engine 100 $BENCH benchmarks/bench_cuda_engine.py $ARGS --model "$ENGINE_MODEL"
fi
if has transform; then
    step bench_transform 60 $BENCH benchmarks/bench_transform.py $ARGS --cuda --quick
fi
if has pipeline; then
    step bench_pipeline 60 $BENCH benchmarks/bench_pipeline.py $ARGS --quick --cuda
fi
if has flying; then
    step bench_flying 40 $BENCH benchmarks/bench_flying.py $ARGS --quick --cuda
fi
if has kunserve; then
    step bench_kunserve 40 $BENCH benchmarks/bench_kunserve.py $ARGS --cuda
fi
if has memcheck; then
    # the kernels against their references under memcheck (out-of-bounds and misaligned device
    # accesses, leaks of cudaMalloc'd memory); last, since it is the slowest
    step memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 \
        $PY -m pytest -q -p no:cacheprovider -x tests/test_cuda.py
fi
# one file back: every benchmark's JSON under its name
$PY - "$OUT/gpu_check.json" <<'EOF'
import json, pathlib, sys
results = pathlib.Path("benchmarks/results")
files = sorted([*results.glob("bench_cuda_*.json"), *results.glob("bench_*_cuda.json")])
out = {p.stem: json.loads(p.read_text()) for p in files}
pathlib.Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
print(f"wrote {sys.argv[1]}: {', '.join(out) or 'nothing'}")
EOF
exit 0
