#!/usr/bin/env bash
# The GPU path's checks (issue 27), for a machine with CuPy and a CUDA GPU:
#  1. `vcluster bench collectives` of all_reduce on CuPy devices, resident in device
#     memory shared through CUDA IPC beside staged through the host (same run);
#  2. the array-module suite (every collective x algorithm, MatMul, FeedForward, MLP
#     schedules, GPT, checkpoints) and the runtime's CuPy test, on CuPy.
# Logs and the benchmark's JSON go to $OUT (default ./gpu-check). Exit status 1 if any
# step failed. Time limits: BENCH_LIMIT_S (default 120), TEST_LIMIT_S (default 600).
set -u -o pipefail
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L || true
python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__,
'CUDA devices', cupy.cuda.runtime.getDeviceCount())" || exit 1
rc=0
timeout "${BENCH_LIMIT_S:-120}" python3 -m vcluster bench collectives --devices 8 \
    --sizes 8B,64MiB --ops all_reduce --array-module cupy --transport ipc,host \
    --json "$out/gpu-check-bench.json" 2>&1 | tee "$out/gpu-check-bench.log" || rc=1
timeout "${TEST_LIMIT_S:-600}" python3 -m pytest -q -rs --timeout 120 -p no:cacheprovider \
    tests/array_modules tests/runtime/test_cluster.py -k cupy 2>&1 \
    | tee "$out/gpu-check-tests.log" || rc=1
exit $rc
