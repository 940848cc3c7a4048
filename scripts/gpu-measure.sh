#!/usr/bin/env bash
# Measure this machine's GPU against the timing model (issue 26), for a machine with CUDA
# and torch: the kernel sweep (hardware calibrate --gpu), the shipped kernel table re-timed
# alone and in a stream, a 1.4B GPT step at micro-batches 1-8 (eager and torch.compile)
# and two other sizes, each beside the calibrated file's prediction. Everything lands in
# $OUT/gpu-measure.tgz (re-packed after every step, so a run stopped midway keeps what it
# measured) and the log in $OUT/gpu-measure.log. Default OUT: ./gpu-measure.
set -u -o pipefail
out=${OUT:-gpu-measure}
work=$(mktemp -d)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
model="--hidden 2048 --layers 24 --heads 16 --seq 2048 --vocab 51200"
rc=0
step() {   # step NAME SECONDS ARGS...: run one command with a limit, log it, re-pack
    local name=$1 limit=$2; shift 2
    echo "== $name ($(date +%T))"
    timeout "$limit" "$@" 2>&1 | tee "$work/$name.log" || { rc=1; echo "== $name FAILED"; }
    tar czf "$out/gpu-measure.tgz" -C "$work" .
}
{
nvidia-smi -L || true
step calibrate 150 python3 -m vcluster hardware calibrate --gpu --out "$work/calibrated.yaml"
hw=()
if [ -s "$work/calibrated.yaml" ]; then hw=(--hardware "$work/calibrated.yaml"); fi
for mb in 1 2 4 8; do
    step "step-mb$mb" 60 python3 -m vcluster bench gpu-step $model --micro-batch $mb \
        "${hw[@]}" --json "$work/step-mb$mb.json"
done
step kernels 150 python3 benchmarks/kernels_alone_vs_stream.py --out "$work/kernels.csv"
for mb in 4 1; do
    step "step-mb$mb-compiled" 120 python3 -m vcluster bench gpu-step $model --micro-batch $mb \
        --compile "${hw[@]}" --json "$work/step-mb$mb-compiled.json"
done
step step-350m-mb8 60 python3 -m vcluster bench gpu-step --hidden 1024 --layers 24 \
    --heads 16 --seq 2048 --vocab 51200 --micro-batch 8 "${hw[@]}" --json "$work/step-350m-mb8.json"
step step-2p7b-mb2 90 python3 -m vcluster bench gpu-step --hidden 2560 --layers 32 \
    --heads 32 --seq 2048 --vocab 51200 --micro-batch 2 "${hw[@]}" --json "$work/step-2p7b-mb2.json"
echo "== done ($(date +%T)), rc $rc"
echo $rc > "$work/rc"
} 2>&1 | tee "$out/gpu-measure.log"
rc=$(cat "$work/rc" 2>/dev/null || echo 1)
rm -rf "$work"
exit "$rc"
