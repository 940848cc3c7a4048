#!/usr/bin/env bash
# One-GPU steps at shapes no constant or formula of the model was chosen on (issue 26):
# `vcluster bench gpu-step` (eager PyTorch AMP) at new vocabularies, sequence lengths,
# widths and micro-batches, each beside this tree's prediction (step time on the GPU's
# preset, peak memory under --precision torch_amp). The shapes were fixed before the run.
# Every JSON lands in $OUT (default ./gpu-held-out), the log in $OUT/held-out.log.
set -u -o pipefail
out=${OUT:-gpu-held-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
rc=0
step() {   # step NAME ARGS...: one measured step, 150 s at most
    local name=$1; shift
    echo "== $name ($(date +%T))"
    timeout 150 python3 -m vcluster bench gpu-step "$@" --json "$out/$name.json" \
        || { rc=1; echo "== $name FAILED"; }
}
{
nvidia-smi -L || true
step 0.4b-v32k-mb4    --hidden 1024 --layers 24 --heads 16 --seq 2048 --vocab 32000 --micro-batch 4
step 0.4b-v128k-mb2   --hidden 1024 --layers 24 --heads 16 --seq 2048 --vocab 128256 --micro-batch 2
step 1.4b-v128k-mb2   --hidden 2048 --layers 24 --heads 16 --seq 2048 --vocab 128256 --micro-batch 2
step 1.4b-s4096-mb2   --hidden 2048 --layers 24 --heads 16 --seq 4096 --vocab 51200 --micro-batch 2
step 0.7b-s1024-mb16  --hidden 1536 --layers 24 --heads 16 --seq 1024 --vocab 50304 --micro-batch 16
step 2.8b-mb1         --hidden 2560 --layers 32 --heads 32 --seq 2048 --vocab 51200 --micro-batch 1
step 30m-v32k-mb32    --hidden 512 --layers 8 --heads 8 --seq 1024 --vocab 32000 --micro-batch 32
echo "== done ($(date +%T)), rc $rc"
} 2>&1 | tee "$out/held-out.log"
exit $rc
