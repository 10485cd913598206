#!/usr/bin/env bash
# The frameworks' newest releases against our integrations: tests/constraints.txt pins
# transformers, accelerate, lightning, deepspeed and torchtitan for reproducibility; this check puts the
# newest release of each (that installs beside the main lane's torch 2.13.0) in a cached venv
# that sees the main lane's packages, prints what it got, and runs the framework cells
# (tests/frameworks: the HF Trainer, Accelerate, Lightning, DeepSpeed on 2 gloo ranks).
# Run it after `bash tests/run.sh`; CI runs it when CI_NEWEST_FRAMEWORKS=1 (it adds
# several minutes), and the last result is quoted in docs/torch-support.md.
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${NANSENTINEL_LANE_CACHE:-$HOME/.cache/nansentinel}"
venv="$cache/frameworks-newest"
packages=(transformers accelerate lightning deepspeed torchtitan)
if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$cache"
    python3 -m venv --system-site-packages "$venv"
fi
# torch stays the main lane's: a constraint keeps the resolver from moving it.
constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
python3 -c "import torch; print('torch==' + torch.__version__.split('+')[0])" >"$constraint"
PIP_CONSTRAINT="$constraint" "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    --upgrade "${packages[@]}"
echo "newest frameworks: $("$venv/bin/python" - <<'PY'
from importlib.metadata import version
print(", ".join(f"{p} {version(p)}" for p in
                ("torch", "transformers", "accelerate", "lightning", "deepspeed", "torchtitan")))
PY
)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$venv/bin/python" -m pytest -p no:cacheprovider tests/frameworks "$@"
