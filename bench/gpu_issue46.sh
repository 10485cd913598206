#!/usr/bin/env bash
# Issue 46's GPU checks, about 2.5 minutes on one H200 (each part bounded by `timeout`, 5 at most),
# and issue 61's torchtitan FT case (4 GPUs; skipped on fewer):
#
#   bash bench/gpu_issue46.sh        # from the repository root; results in $OUT or bench/results
#
# 1. gpu_correctness.py (~30 s): the NCCL-only paths, DDP's world-1 average now under DDP's
#    own C++ all-reduce (no comm hook on NCCL): PASS/FAIL each.
# 2. gpu_syncs.py (~40 s): host syncs the default adds per healthy step, DDP and FSDP2 x
#    foreach and fused AdamW, NCCL at world size 1 (device gate: 0; host gate: <= 1), then 2
#    gloo ranks over CUDA tensors (<= 1.2). Exit 1 if a promise broke.
# 3. hook_cost.py (~25 s): host work per DDP bucket: DDP's C++ all-reduce, a bare Python
#    comm hook, the sentinel (NCCL: no hook, one callback), its comm hook, and its comm hook
#    checking every bucket as before issue 46.
# 4. gpu_checks.py --large (~70 s): the 625 M bf16 fused-AdamW step ratio against plain DDP:
#    the default (sentinel: decided in step() after the optimizer is queued, no comm hook),
#    gate="device" (decided at the next call), the host gate forced, a bare Python comm hook.
# 5. gpu_titan_ft.py (~60 s; issue 61): torchtitan's fault-tolerant trainer under the sentinel,
#    2 torchft replica groups x 2 ranks (FSDP2 over NCCL inside, torchft's NCCL group across),
#    a NaN on group 1's rank 1: PASS when vetoed on every rank, named alone, group 1 left and
#    group 0 trained on. Needs 4 GPUs (NCCL: one rank of a communicator per GPU), else SKIP.
set -uo pipefail

cd "$(dirname "$0")/.."
RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
{
    echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo no-git)"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
    python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
} | tee "$RESULTS/gpu_env46.txt"
part() {  # part NAME SECONDS COMMAND...: one bounded run, its log under $RESULTS
    local name=$1 secs=$2; shift 2
    echo "== $name: $*"
    timeout "$secs" "$@" 2>&1 | tee "$RESULTS/$name.log"
    local rc=${PIPESTATUS[0]}
    [[ $rc -eq 0 ]] || { echo "== $name exited $rc"; status=$rc; }
}
part correctness 60 python bench/gpu_correctness.py --json "$RESULTS/correctness46.json"
part syncs 90 python bench/gpu_syncs.py
part hooks 45 python bench/hook_cost.py --steps 150 --json "$RESULTS/hook_cost46.json"
part big_fused 110 python bench/gpu_checks.py --large --optimizer fused --steps 14 --warmup 2 \
    --burst 2 --memory-steps 0 --check-reps 5 \
    --variants baseline,sentinel,sentinel_device,sentinel_host,pyhook \
    --json "$RESULTS/big_fused46.json"
part titan_ft 300 python bench/gpu_titan_ft.py --out "$RESULTS"
echo "gpu_issue46.sh: done (exit $status); results in $RESULTS"
exit "$status"
