#!/usr/bin/env bash
# The test command of the README: installs what the suite needs, then runs ruff, mypy (the
# package, with [tool.mypy] in pyproject.toml) and pytest.
# Extra arguments go to pytest (e.g. `bash tests/run.sh tests/unit -q`).
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages for the end-to-end tests: real Prometheus and Alertmanager (promtool, amtool),
# iproute2 for the network-namespace hosts, openssl for the exporter's TLS test, chromium to
# render the incident page in a real (headless) browser, slurm-wlm and munge for a real Slurm
# on those hosts (tests/e2e/slurm.py; the services are not started by the install).
need=()
for pair in prometheus:prometheus promtool:prometheus prometheus-alertmanager:prometheus-alertmanager \
            amtool:prometheus-alertmanager ip:iproute2 openssl:openssl chromium:chromium \
            slurmctld:slurm-wlm slurmd:slurm-wlm sbatch:slurm-wlm munged:munge nsenter:util-linux; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair##*:}")
done
if ((${#need[@]})); then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    echo "installing Debian packages: ${need[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        $(printf '%s\n' "${need[@]}" | sort -u) >/dev/null
fi

# The pinned CPU build of torch first (an unpinned torch pulls a multi-GB CUDA build), then us
# with the extras, the test tools and the frameworks the suite runs under, at the versions CI
# tests (tests/constraints.txt; the package itself declares ranges).
python3 -m pip install -q -c tests/constraints.txt torch
python3 -m pip install -q -c tests/constraints.txt -e '.[lightning,transformers,report]' \
    -r tests/requirements.txt -r tests/requirements-main.txt

python3 -m ruff check .
python3 -m mypy
python3 -m pytest "$@"
