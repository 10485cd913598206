#!/usr/bin/env bash
# The second CI lane: the unit tests and the distributed tests that lean on torch's internals
# (DDP's comm hook, FSDP2's reduce-scatter, DTensor placements, pipelining, the exchange's
# collectives), on the newest torch this machine can install, beside the main lane's pinned
# 2.13. Run it after `bash tests/run.sh` (CI does): its venv sees the main lane's packages
# (--system-site-packages) and holds only the newer torch, so nothing is installed twice.
# Extra arguments go to pytest. TORCH_NEWEST picks the version (default 2.14.1: pip on this
# machine is capped there; a plain newer torch is a multi-GB CUDA build either way, and runs on
# the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

version="${TORCH_NEWEST:-2.14.1}"
venv="${NANSENTINEL_NEWEST_VENV:-${TMPDIR:-/tmp}/nansentinel-torch-$version}"
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" \
        2>/dev/null; then
    echo "installing torch==$version into $venv"
    python3 -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install -q "torch==$version"
fi
found="$("$venv/bin/python" -c "import torch; print(torch.__version__)")"
case "$found" in
    "$version"|"$version"+*) echo "second lane: torch $found" ;;
    *) echo "the second lane wants torch $version, $venv has $found" >&2; exit 1 ;;
esac

# The package from this checkout, not the main lane's editable install (same files; explicit).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# (The watchdog's slow-work test is about our timer, not torch's internals: the main lane's.)
"$venv/bin/python" -m pytest -p no:cacheprovider tests/unit \
    tests/distributed/test_ddp_average.py tests/distributed/test_fsdp.py \
    tests/distributed/test_tp.py tests/distributed/test_pipeline.py \
    tests/distributed/test_wire.py tests/distributed/test_device_gate.py \
    tests/distributed/test_ddp_last_bucket.py tests/distributed/test_fsdp_device_gate.py \
    --deselect tests/distributed/test_fsdp.py::test_the_watchdog_spares_slow_work_between_micro_batches \
    "$@"
