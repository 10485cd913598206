#!/usr/bin/env bash
# One torch lane of CI: the unit tests and the distributed tests that lean on torch's insides
# (DDP's comm hook, FSDP2/HSDP's reduce-scatter, FSDP1's comm hook, TP's DTensors, pipelining,
# the exchange's collectives, the device gate) on one torch release, beside the main lane's pinned 2.13.
#
#   bash tests/run_torch_lane.sh VERSION [pytest args]      e.g. 2.9.1 (the oldest), 2.15.0
#
# Run it after `bash tests/run.sh` (CI does): the lane's venv sees the main lane's packages
# (--system-site-packages) and holds only its own torch, so nothing is installed twice. The
# venvs are cached in $NANSENTINEL_LANE_CACHE (default ~/.cache/nansentinel): a torch release is
# a multi-GB CUDA build from the registry (it runs on the CPU), fetched once per machine.
# pip here may be capped below the newest release by a global constraint file: the lane's one
# install lifts it (PIP_CONSTRAINT=/dev/null); the version installed is exactly VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."

version="${1:?usage: bash tests/run_torch_lane.sh VERSION [pytest args]}"
shift
cache="${NANSENTINEL_LANE_CACHE:-$HOME/.cache/nansentinel}"
venv="$cache/torch-$version"
have() {
    "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" \
        2>/dev/null
}
if ! have; then
    echo "installing torch==$version into $venv"
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv --system-site-packages "$venv"
    PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --disable-pip-version-check \
        "torch==$version"
    have || { echo "the lane wants torch $version, $venv has another" >&2; exit 1; }
fi
echo "torch lane: $("$venv/bin/python" -c "import torch; print(torch.__version__)")"

# The package from this checkout, not the main lane's editable install (same files; explicit).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Left to the main lane: the docs (they show torch 2.13's API and torchtitan 0.3.0, which
# needs 2.13), the watchdog's slow-work test (about our timer, not torch's insides), the
# unit tests that use no torch API (config ranges, the exclusion file, the report readers,
# the untrusted-file reader, the CLI's torch-free commands, the import graph), and two that
# start a Python of their own to test our signal handling and our imports, not torch's (a
# lane's 20 s): the same on every release, run once.
# LANE_UNIT_TESTS=0: the distributed tests only (CI's middle release: the unit tests'
# plain tensor API is held at both ends of the range, the seams on every lane).
unit=(tests/unit)
[ "${LANE_UNIT_TESTS:-1}" = 0 ] && unit=()
"$venv/bin/python" -m pytest -p no:cacheprovider "${unit[@]}" \
    tests/distributed/test_ddp_average.py tests/distributed/test_fsdp.py \
    tests/distributed/test_fsdp1.py \
    tests/distributed/test_tp.py tests/distributed/test_pipeline.py \
    tests/distributed/test_wire.py tests/distributed/test_device_gate.py \
    tests/distributed/test_ddp_last_bucket.py tests/distributed/test_fsdp_device_gate.py \
    tests/distributed/test_prehook.py \
    --ignore tests/unit/test_docs.py \
    --ignore tests/unit/test_config_properties.py --ignore tests/unit/test_config_ranges.py \
    --ignore tests/unit/test_exclusion.py --ignore tests/unit/test_exclusion_hostile.py \
    --ignore tests/unit/test_incidents_cli.py --ignore tests/unit/test_incidents_hostile.py \
    --ignore tests/unit/test_untrusted.py \
    --ignore tests/unit/test_cli_newcomer.py --ignore tests/unit/test_import_graph.py \
    --deselect tests/distributed/test_fsdp.py::test_the_watchdog_spares_slow_work_between_micro_batches \
    --deselect tests/unit/test_stop.py::test_sigterm_becomes_a_stop_only_where_the_default_handler_was \
    --deselect tests/unit/test_deepspeed.py::test_nansentinel_never_imports_deepspeed \
    "$@"
# The invariant matrix on the engine whose seam is this release's own: the collective
# pre-hooks (torch >= 2.14) that check gradients reduced by hand; the main lane (2.13) runs
# the other engines' share.
if "$venv/bin/python" -c "import sys, torch.distributed as d; sys.exit(not hasattr(d.ProcessGroup, 'register_pre_hook'))"; then
    NANSENTINEL_MATRIX_ENGINES=PreHookPath "$venv/bin/python" -m pytest -p no:cacheprovider \
        tests/distributed/test_invariants.py "$@"
fi
