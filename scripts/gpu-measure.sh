#!/usr/bin/env bash
# Measure this machine's GPU against the timing model (issue 26), for a machine with CUDA
# and torch: the kernel sweep (hardware calibrate --gpu), a 1.3B GPT step beside the
# preset's and the calibrated file's predictions, a micro-batch sweep, torch.compile, and
# the GPU half of tests/gpu. Output in $OUT (default ./gpu-measure).
set -u -o pipefail
out=${OUT:-gpu-measure}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
model="--hidden 2048 --layers 24 --heads 16 --seq 2048 --vocab 51200"
rc=0
step() {   # step NAME SECONDS ARGS...: run one command with a limit, log it
    local name=$1 limit=$2; shift 2
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" || rc=1
}
step calibrate 90 python3 -m vcluster hardware calibrate --gpu --out "$out/calibrated.yaml"
step step-mb4 60 python3 -m vcluster bench gpu-step $model --micro-batch 4 --json "$out/step-mb4.json"
step step-mb4-calibrated 60 python3 -m vcluster bench gpu-step $model --micro-batch 4 \
    --hardware "$out/calibrated.yaml" --json "$out/step-mb4-calibrated.json"
for mb in 1 2 8; do
    step "step-mb$mb" 60 python3 -m vcluster bench gpu-step $model --micro-batch $mb \
        --json "$out/step-mb$mb.json"
done
step tests 90 python3 -m pytest -q -p no:cacheprovider tests/gpu
step step-mb4-compiled 100 python3 -m vcluster bench gpu-step $model --micro-batch 4 \
    --compile --json "$out/step-mb4-compiled.json"
exit $rc
