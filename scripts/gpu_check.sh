#!/usr/bin/env bash
# The one GPU verification script: installs nothing, prints everything, < 8 minutes on one H100/H200
# (the step time limits add up to 470 s; the benchmark prints each contender as it finishes).
#
#   bash scripts/gpu_check.sh            # from the repository root, on a machine with CuPy, PyTorch, nvcc
#
# Through the device tool: run(command="bash scripts/gpu_check.sh", timeout_s=570); the logs come back
# from $OUT (nvcc, pytest, check, flash, bench: five files).
#
# Runs, in order (each step's output also goes to $OUT/<step>.log when OUT is set):
#   0. environment: GPU, driver, CuPy / PyTorch versions
#   1. nvcc: every kernel built for sm_90 with register / spill / shared-memory report (ptxas -v)
#   2. pytest tests/test_gpu.py on the device (compile tests + device tests; the CPU-emulated ones are skipped)
#   3. `nanoeuler check --device gpu`: every kernel vs the NumPy reference, then every parameter's gradient
#      GPU (fp32, TF32 off) vs CPU (float64), tolerance 1e-5
#   4. the tensor-core (WMMA, bf16) FlashAttention vs the reference (bf16 tolerance); 30 GPU training steps
#      saved as a checkpoint and reloaded on the CPU (same loss); FlashAttention at T = 512, 2048, 8192
#      (B=1, H=12/4, hd=64) vs float64 attention, with fp32 and tensor-core timings; the peak memory of
#      FlashAttention vs naive T×T attention at T = 8192
#   5. bench/gpu_speed.py: gpt preset, ours vs PyTorch eager (SDPA) vs torch.compile, bf16, tokens/s, MFU, memory
# Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOGDIR=${OUT:-/tmp/nanoeuler_gpu_check}
mkdir -p "$LOGDIR"
failed=()

step() {  # step NAME TIMEOUT_S CMD...
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$LOGDIR/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

echo "=== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
$PY -c "import sys, numpy, cupy, torch; print('python', sys.version.split()[0], '| numpy', numpy.__version__, '| cupy', cupy.__version__, '| torch', torch.__version__, '| cuda devices', cupy.cuda.runtime.getDeviceCount())"
nvcc --version | tail -1

build_all() {
    local k=nanoeuler/gpu/kernels tmp
    tmp=$(mktemp -d)
    for f in $k/*.cu; do
        echo "--- $f"
        nvcc -arch=sm_90 -cubin -std=c++17 -I$k -Xptxas -v -o "$tmp/$(basename "$f").cubin" "$f" 2>&1 \
            | grep -E "error|warning|Compiling entry|Used|spill" || true
        [ -s "$tmp/$(basename "$f").cubin" ] || return 1
    done
    echo "--- flash_attention_wmma.cu at head dim 32"
    nvcc -arch=sm_90 -cubin -std=c++17 -I$k -DFA_HD=32 -Xptxas -v -o "$tmp/fw32.cubin" $k/flash_attention_wmma.cu 2>&1 \
        | grep -E "error|warning|Used|spill" || true
    [ -s "$tmp/fw32.cubin" ] || return 1
    echo "--- flash_attention.cu at head dim 128"
    nvcc -arch=sm_90 -cubin -std=c++17 -I$k -DFA_HD=128 -Xptxas -v -o "$tmp/fa128.cubin" $k/flash_attention.cu 2>&1 \
        | grep -E "error|warning|Used|spill" || true
    [ -s "$tmp/fa128.cubin" ]
}

export -f build_all  # (timeout runs programs, not shell functions)
step nvcc 60 bash -c build_all
step pytest 60 $PY -m pytest -q -p no:cacheprovider -k "not emulated and not test_gpu_check_passes" tests/test_gpu.py
step check 90 $PY -m nanoeuler check --device gpu
step flash 120 $PY -m nanoeuler.gpu.check --long --no-rows
step bench 140 $PY bench/gpu_speed.py --preset gpt --batch 16 --steps 10 --warmup 3 --cuda-core-attention-too

echo
echo "=== SUMMARY"
grep -h "max relative error" "$LOGDIR/check.log" 2>/dev/null | sed 's/^/check: /'
grep -h -E "bf16 kernels|GPU training|^flash T=|tensor-core bf16 kernels|^memory at" "$LOGDIR/flash.log" 2>/dev/null
grep -h -E "tok/s|ours / PyTorch" "$LOGDIR/bench.log" 2>/dev/null
grep -h -E "passed|failed" "$LOGDIR/pytest.log" 2>/dev/null | tail -1 | sed 's/^/pytest: /'
if [ ${#failed[@]} -eq 0 ]; then
    echo "=== ALL STEPS PASSED"
else
    echo "=== FAILED STEPS: ${failed[*]}"
    exit 1
fi
