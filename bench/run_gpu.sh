#!/usr/bin/env bash
# The one prepared run for a lent GPU machine: nansentinel's overhead on one CUDA GPU.
#
#   bash bench/run_gpu.sh            # from the repository root; results in $OUT or bench/results
#
# Installs nothing unless it must: the checkout is put on PYTHONPATH, and only when
# `import nansentinel` still fails is `pip install -e .` tried (torch must already be there).
# Each run is bounded by `timeout` (all together at most 14 minutes; RUN_ONLY="big_fused syncs"
# runs only the named parts, to split it over two commands); logs and
# JSON are written as it goes, so a run cut short still leaves what it measured.
set -uo pipefail

cd "$(dirname "$0")/.."
RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! python -c 'import nansentinel' 2>"$RESULTS/import.log"; then
    pip install -e . >"$RESULTS/pip.log" 2>&1 \
        || { echo "run_gpu.sh: nansentinel does not import and pip install -e . failed;" \
                  "see $RESULTS/import.log and $RESULTS/pip.log" >&2; exit 1; }
fi

{
    echo "# $(date -u +%FT%TZ) $(hostname)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1
    python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} | tee "$RESULTS/gpu_env.txt"

status=0
run() {  # run NAME SECONDS ARGS...: one bounded gpu_checks run, log and JSON under $RESULTS
    local name=$1 secs=$2; shift 2
    if [[ -n "${RUN_ONLY:-}" && " $RUN_ONLY " != *" $name "* ]]; then return; fi
    echo "== $name: gpu_checks.py $*"
    timeout "$secs" python bench/gpu_checks.py "$@" --json "$RESULTS/$name.json" \
        2>&1 | tee "$RESULTS/$name.log" || status=$?
}
# 0. The NCCL-only hazards of issue 20 (items 5, 6, 8): PASS/FAIL a check, exit 1 on a FAIL.
if [[ -z "${RUN_ONLY:-}" || " $RUN_ONLY " == *" correctness "* ]]; then
    echo "== correctness: gpu_correctness.py"
    timeout 120 python bench/gpu_correctness.py --json "$RESULTS/correctness.json" \
        2>&1 | tee "$RESULTS/correctness.log" || status=$?
fi
# 1. ~110 M parameters, fp32: the foreach pair and the fused pair, each with the cost of one
#    blocking read before the optimizer (sync) beside it.
run large_foreach 90 --optimizer foreach --steps 40 --memory-steps 0 --check-reps 20 \
    --variants baseline,sentinel,sync,pyhook
run large_fused 90 --optimizer fused --steps 40 --memory-steps 0 --check-reps 20 \
    --variants baseline,sentinel,sentinel_host,sync
# 2. ~0.6 B parameters, bf16 autocast (the issue's model), fused: the breakdown, six variants
#    alive at once (~12 GB each); burst 2 lets the host run ahead as real training does.
run big_fused 150 --large --optimizer fused --steps 24 --warmup 3 --burst 2 \
    --memory-steps 0 --check-reps 10 \
    --variants baseline,sentinel,sentinel_device,sentinel_host,pyhook,sentinel_nochecks
run big_foreach 90 --large --optimizer foreach --steps 16 --warmup 3 --burst 2 \
    --memory-steps 0 --check-reps 10 --variants baseline,sentinel,sync
# 3. What bucket_cap_mb does to the comm hook's cost (fewer, larger buckets: less Python).
run big_fused_bucket100 75 --large --optimizer fused --bucket-cap-mb 100 --steps 16 --warmup 3 \
    --burst 2 --memory-steps 0 --check-reps 10 --variants baseline,sentinel,pyhook
# 4. The CPU benchmark's model (host-bound), with peak memory both ways: in one process after
#    the timing (as before: 1.177 for every non-baseline variant) and each in a fresh process.
run small_fused 60 --cpu-size --optimizer fused --steps 60 --check-reps 20 \
    --variants baseline,sentinel,pyhook
run small_memory_fresh 60 --cpu-size --optimizer fused --steps 4 --warmup 1 --check-reps 5 \
    --memory-fresh --variants baseline,sentinel,pyhook

# 5. Host syncs per healthy step added by the sentinel, by the gate each run took: NCCL at
#    world size 1, DDP and FSDP2 (device gate: 0; host gate: at most 1), for the default and
#    each gate; then 2 gloo ranks over CUDA tensors (the multi-rank path; at most 1, plus one
#    per replica check). Each path spawns its ranks (~10 s of imports).
[[ -n "${RUN_ONLY:-}" && " $RUN_ONLY " != *" syncs "* ]] || timeout 120 python bench/gpu_syncs.py --gates auto,device,host 2>&1 | tee "$RESULTS/gpu_syncs.log" || status=$?

# 5b. The comm hook's host work per bucket against a bare Python hook (issue 46), before
#     (every bucket checked in its own call) and after (the check on the last bucket).
[[ -n "${RUN_ONLY:-}" && " $RUN_ONLY " != *" hooks "* ]] || timeout 90 python bench/hook_cost.py --json "$RESULTS/hook_cost.json" 2>&1 | tee "$RESULTS/hook_cost.log" || status=$?

# 6. The framework x engine cells of docs/frameworks.md on the GPUs, without the CPU patches
#    (~5 min on one GPU): not in the default run (its 13 minutes); RUN_ONLY=frameworks runs it.
if [[ " ${RUN_ONLY:-} " == *" frameworks "* ]]; then
    echo "== frameworks: gpu_frameworks.py"
    timeout 540 python bench/gpu_frameworks.py --json "$RESULTS/frameworks.json" \
        2>&1 | tee "$RESULTS/frameworks.log" || status=$?
fi

echo "run_gpu.sh: done (exit $status); results in $RESULTS"
exit "$status"
