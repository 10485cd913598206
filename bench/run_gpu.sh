#!/usr/bin/env bash
# The one prepared run for a lent GPU machine: nansentinel's overhead on one CUDA GPU.
#
#   bash bench/run_gpu.sh            # from the repository root; results in $OUT or bench/results
#
# Installs nothing unless it must: the checkout is put on PYTHONPATH, and only when
# `import nansentinel` still fails is `pip install -e .` tried (torch must already be there).
# Each run is bounded by `timeout`, so the whole script ends within about 7 minutes; logs and
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
# 1. A GPU-sized model (~110 M parameters): is the sentinel within 1% when the GPU is busy?
timeout 240 python bench/gpu_checks.py --steps 40 --json "$RESULTS/gpu_large.json" \
    2>&1 | tee "$RESULTS/gpu_large.log" || status=$?
# 2. The CPU benchmark's model: short steps, where the sentinel's host-side cost shows most.
timeout 100 python bench/gpu_checks.py --cpu-size --steps 100 --json "$RESULTS/gpu_small.json" \
    2>&1 | tee "$RESULTS/gpu_small.log" || status=$?

# 3. Host syncs per step added by the sentinel (the promise: at most one, at the decision).
timeout 60 python bench/gpu_syncs.py 2>&1 | tee "$RESULTS/gpu_syncs.log" || status=$?

echo "run_gpu.sh: done (exit $status); results in $RESULTS"
exit "$status"
