#!/usr/bin/env bash
# The GPU verification script, in two halves that each fit a short device slot. Installs nothing.
#
#   bash scripts/gpu_check.sh quick    # environment, nvcc, kernel checks, whole-model gradients, tensor-core
#                                      # attention: step limits add up to 165 s (<= 3 min)
#   bash scripts/gpu_check.sh full     # round trip, FlashAttention scaling, memory, device pytest, benchmark,
#                                      # torch.compile in its own step: step limits add up to 465 s (env included)
#   bash scripts/gpu_check.sh all      # both (610 s of limits: env runs once)
#   GPU_CHECK_EMULATE=1 bash scripts/gpu_check.sh quick   # rehearsal on the CPU emulator (tests/gpu_emu):
#                                      # same steps, tiny shapes, no GPU; steps needing CUDA torch are skipped
#
# Through the device tool: run(command="bash scripts/gpu_check.sh quick", timeout_s=240), then
# run(command="bash scripts/gpu_check.sh full", timeout_s=500). Every step's output goes to its own file
# under $OUT (env.log, nvcc.log, kernels.log, ...), and steps.tsv has each step's limit, seconds and exit
# status, since only the last 12,000 characters of the console come back.
#
# Planned device budget (H200; 15 min per task, machine start included), limit / expected:
#   quick  env 20 / 5 s         versions, GPU, driver, which CUDA include folder the WMMA kernels will use
#          nvcc 45 / 20 s       every kernel to an sm_90 cubin in parallel, registers / spills / shared memory
#          kernels 60 / 30 s    every kernel vs the NumPy reference, every parameter's gradient GPU vs CPU
#                               (NVRTC compiles the kernels cold here; CuPy caches them on disk for later steps)
#          tensor-core 40 / 10 s  WMMA FlashAttention (bf16) rows, bf16 outputs
#   full   roundtrip 45 / 10 s  30 GPU training steps, checkpoint reloaded on the CPU (reference path)
#          flash 75 / 25 s      FlashAttention T = 512, 2048, 8192 vs float64 attention, fp32 and tensor-core times
#          memory 30 / 10 s     peak memory, FlashAttention vs naive T×T attention at T = 8192
#          pytest 45 / 20 s     the device tests and NVRTC compile tests
#          bench 100 / 45 s     gpt preset: ours (named by the attention kernel that ran), PyTorch eager + SDPA,
#                               ours with CUDA-core attention
#          compile 150 / 100 s  torch.compile alone (a cold compile of the 16-layer model takes 60-100 s)
# Rehearsed on the CPU emulator (GPU_CHECK_EMULATE=1 ... all; 2 shared cores at load 15; cold / warm emulator
# build cache, seconds): env 8.7/9.5, nvcc 45.6/50.9 (serially bound here), kernels 28.2/7.8, tensor-core 7.4/2.6,
# roundtrip 2.9/4.4, flash 6.8/4.7, memory 1.0/1.2, pytest 31.3/35.5, bench 12.3/6.7, compile not emulated.
# Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
MODE=${1:-quick}
case "$MODE" in quick|full|all) ;; *) echo "usage: $0 quick|full|all" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
LOGDIR=${OUT:-/tmp/nanoeuler_gpu_check}
mkdir -p "$LOGDIR"
EMULATE=${GPU_CHECK_EMULATE:-0}
SCALE=${GPU_CHECK_LIMIT_SCALE:-$([ "$EMULATE" = 1 ] && echo 10 || echo 1)}  # emulator: 10x the device limits
if [ "$EMULATE" = 1 ]; then  # the CPU emulator: fake CuPy, tiny shapes
    GPY="$PY tests/gpu_emu/run.py"
    SMALL="--small"
    BENCH_ARGS="--preset small --batch 1 --steps 1 --warmup 1"
    BENCH_CONTENDERS="ours,cuda-core"  # PyTorch here has no CUDA
    export NANOEULER_EMU_TINY_SMALL=1  # run.py: the `small` preset becomes a tiny model
else
    GPY="$PY"
    SMALL=""
    BENCH_ARGS="--preset gpt --batch 16 --steps 10 --warmup 3"
    BENCH_CONTENDERS="ours,eager,cuda-core"
fi
failed=()
printf "step\tlimit_s\tseconds\texit\n" > "$LOGDIR/steps.tsv"

step() {  # step NAME TIMEOUT_S CMD...  (output to the console and $LOGDIR/NAME.log; a row in steps.tsv)
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    echo
    echo "=== $name (limit ${limit} s): $*"
    local t0 t1 rc
    t0=$(date +%s.%N)
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$LOGDIR/$name.log"
    rc=${PIPESTATUS[0]}
    t1=$(date +%s.%N)
    local secs
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    [ "$rc" -eq 124 ] && echo "=== $name: TIMED OUT after $limit s" | tee -a "$LOGDIR/$name.log"
    echo "=== $name: exit $rc after $secs s"
    printf "%s\t%s\t%s\t%s\n" "$name" "$limit" "$secs" "$rc" >> "$LOGDIR/steps.tsv"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

skip() {  # skip NAME WHY
    echo
    echo "=== $1: skipped ($2)" | tee "$LOGDIR/$1.log"
    printf "%s\t-\t-\tskipped\n" "$1" >> "$LOGDIR/steps.tsv"
}

environment() {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1 || echo "nvidia-smi: not here"
    nvcc --version 2>&1 | tail -1 || echo "nvcc: not here"
    $PY - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("numpy", "cupy", "torch", "numba"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "unavailable:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
try:
    import cupy
    print("cupy devices", cupy.cuda.runtime.getDeviceCount(), "| cupy CUDA path", cupy.cuda.get_cuda_path(),
          "| runtime", cupy.cuda.runtime.runtimeGetVersion(), "| driver", cupy.cuda.runtime.driverGetVersion())
    print("nvrtc", cupy.cuda.nvrtc.getVersion())
except Exception as e:
    print("cupy device query:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
from importlib import metadata
print("wheels:", ", ".join(sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                                  if (d.metadata["Name"] or "").lower().startswith(("cupy", "nvidia", "torch")))))
from nanoeuler.gpu.runtime import cuda_major, find_cuda_include, gpu_extra, include_candidates
print("CUDA major", cuda_major(), "| extra:", gpu_extra())
print("include candidates:", include_candidates())
print(find_cuda_include()[1])
EOF
}

build_all() {  # every kernel to an sm_90 cubin, in parallel; ptxas reports registers, spills, shared memory
    local k=nanoeuler/gpu/kernels tmp rc=0 name
    tmp=$(mktemp -d)
    build() {  # build NAME SOURCE [DEFINES...]
        local name=$1 src=$2
        shift 2
        nvcc -arch=sm_90 -cubin -std=c++17 -I$k "$@" -Xptxas -v -o "$tmp/$name.cubin" "$src" > "$tmp/$name.log" 2>&1
    }
    local names=()
    for f in $k/*.cu; do
        name=$(basename "$f" .cu)
        names+=("$name")
        build "$name" "$f" &
    done
    names+=(flash_attention_wmma_hd32 flash_attention_hd128)
    build flash_attention_wmma_hd32 $k/flash_attention_wmma.cu -DFA_HD=32 &
    build flash_attention_hd128 $k/flash_attention.cu -DFA_HD=128 &
    wait
    for name in "${names[@]}"; do
        echo "--- $name"
        grep -E "error|warning|Compiling entry|Used|spill" "$tmp/$name.log"
        [ -s "$tmp/$name.cubin" ] || { echo "FAILED: no cubin for $name"; rc=1; }
    done
    rm -rf "$tmp"
    return $rc
}
export -f build_all environment
export PY

quick() {
    step env 20 bash -c environment
    if command -v nvcc > /dev/null; then step nvcc 45 bash -c build_all; else skip nvcc "nvcc not installed"; fi
    step kernels 60 $GPY -m nanoeuler.gpu.check --parts rows $SMALL
    step tensor-core 40 $GPY -m nanoeuler.gpu.check --parts tensor-core $SMALL
}

full() {
    [ -s "$LOGDIR/env.log" ] || step env 20 bash -c environment
    step roundtrip 45 $GPY -m nanoeuler.gpu.check --parts roundtrip $SMALL
    step flash 75 $GPY -m nanoeuler.gpu.check --parts flash $SMALL
    step memory 30 $GPY -m nanoeuler.gpu.check --parts memory $SMALL
    step pytest 45 $PY -m pytest -q -p no:cacheprovider -k "not emulated and not nvcc_compiles and not test_gpu_check_passes" \
        tests/test_gpu.py tests/test_gpu_runtime.py
    step bench 100 $GPY bench/gpu_speed.py $BENCH_ARGS --contenders $BENCH_CONTENDERS
    if [ "$EMULATE" = 1 ]; then
        skip compile "torch.compile needs CUDA torch; not emulated"
    else
        step compile 150 $PY bench/gpu_speed.py $BENCH_ARGS --contenders compile
    fi
}

case "$MODE" in
    quick) quick ;;
    full) full ;;
    all) quick; full ;;
esac

{
    echo
    echo "=== SUMMARY ($MODE$([ "$EMULATE" = 1 ] && echo ", CPU emulator"))"
    grep -h "^CUDA headers\|^no include folder" "$LOGDIR/env.log" 2>/dev/null
    grep -h "max relative error" "$LOGDIR/kernels.log" "$LOGDIR/tensor-core.log" 2>/dev/null
    grep -h -E "ERROR|FAIL|warning: tensor-core" "$LOGDIR"/kernels.log "$LOGDIR"/tensor-core.log 2>/dev/null | head -20
    grep -h -E "GPU training|^flash T=|tensor-core bf16 kernels|^memory at" "$LOGDIR"/roundtrip.log \
        "$LOGDIR"/flash.log "$LOGDIR"/memory.log 2>/dev/null
    grep -h -E "tok/s|/ PyTorch eager|FAILED|note:" "$LOGDIR"/bench.log "$LOGDIR"/compile.log 2>/dev/null
    grep -h -E "passed|failed" "$LOGDIR/pytest.log" 2>/dev/null | tail -1 | sed 's/^/pytest: /'
    echo "--- steps (limit s, seconds, exit):"
    column -t -s $'\t' "$LOGDIR/steps.tsv" 2>/dev/null || cat "$LOGDIR/steps.tsv"
    if [ ${#failed[@]} -eq 0 ]; then
        echo "=== ALL STEPS PASSED"
    else
        echo "=== FAILED STEPS: ${failed[*]}"
    fi
} | tee "$LOGDIR/summary.log"
[ ${#failed[@]} -eq 0 ]
