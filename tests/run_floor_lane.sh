#!/usr/bin/env bash
# The floors lane of CI: what a user gets from an index at the lowest versions the package
# declares. The wheel is built (`pip wheel . --no-deps`) and installed, not editable, in a venv
# of its own that sees nothing of the main lane's (no numpy, which the package does not need),
# beside the lowest version of every dependency its metadata allows (prometheus-client,
# psutil: each `>=` floor, exactly) and the main lane's torch (torch's floor has its own lane,
# tests/run_torch_lane.sh). Then, with the installed package and not the checkout on the path:
# the unit tests, and the demo with its exporters on, scraped while it runs. A floor that is
# false, or a file the wheel lacks, fails here.
#
#   bash tests/run_floor_lane.sh [pytest args]
#
# The venv is cached in $NANSENTINEL_LANE_CACHE (default ~/.cache/nansentinel), keyed by what it
# holds; each run installs the freshly built wheel into it.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"

cache="${NANSENTINEL_LANE_CACHE:-$HOME/.cache/nansentinel}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The wheel, from a copy of what a build reads (a stale build/ folder of the checkout cannot
# ship a file the source no longer has).
mkdir "$work/source"
cp pyproject.toml README.md "$work/source/"
cp -r nansentinel "$work/source/"
find "$work/source" -name __pycache__ -prune -exec rm -rf {} +
python3 -m pip wheel -q --no-deps -w "$work/dist" "$work/source"
wheel="$(echo "$work"/dist/nansentinel-*.whl)"

# The floors: every dependency the wheel declares with a lower bound, at that bound (torch at
# the version CI pins, tests/constraints.txt).
floors="$(python3 - "$wheel" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    text = whl.read(meta).decode()
for line in text.splitlines():
    m = re.match(r"Requires-Dist: ([A-Za-z0-9_.-]+)\s*\(?([^;]*?)\)?\s*$", line)
    if not m or m.group(1).lower() == "torch":
        continue  # an extra's (it has a marker) or torch's: neither is this lane's
    low = re.search(r">=\s*([\w.]+)", m.group(2))
    if low:
        print(f"{m.group(1)}=={low.group(1)}")
PY
)"
torch_pin="$(grep -E '^torch==' tests/constraints.txt)"
key="$(printf '%s\n' $floors "$torch_pin" $(grep -vE '^\s*(#|$)' tests/requirements.txt) \
    | sha256sum | cut -c1-12)"
venv="$cache/floors-$key"
if [ ! -x "$venv/bin/python" ]; then
    echo "floors lane: building $venv"
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "$torch_pin" $floors \
        -r tests/requirements.txt
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall \
    "$wheel"
"$venv/bin/python" -m pip check
echo "floors lane: $("$venv/bin/python" - <<'PY'
from importlib.metadata import version
print(", ".join(f"{p} {version(p)}" for p in ("nansentinel", "torch", "prometheus-client",
                                                "psutil")))
PY
)"

# From a folder outside the checkout: the installed package, not the source tree, is imported
# (the tests are found by path; --import-mode=append puts the checkout after site-packages).
cd "$work"
TESTS_AGAINST_INSTALL=1 "$venv/bin/python" -c '
import importlib.util, sys
assert importlib.util.find_spec("numpy") is None, "numpy is in the floors venv"
import nansentinel
print("floors lane: nansentinel from", nansentinel.__file__)
assert "site-packages" in nansentinel.__file__, nansentinel.__file__
'
# The unit tests the torch lanes leave to the main lane read the checkout's own files (docs,
# import graph) and are left to it here too; the rest run against the wheel.
TESTS_AGAINST_INSTALL=1 "$venv/bin/pytest" -p no:cacheprovider --import-mode=append \
    --rootdir="$repo" -c "$repo/pyproject.toml" "$repo/tests/unit" \
    --ignore "$repo/tests/unit/test_docs.py" --ignore "$repo/tests/unit/test_import_graph.py" \
    "$@"

# The demo with metrics on, as a user runs it from the install: its exporters scraped while it
# trains (the last rank's, which saw the drill), the run ending 0 with the fault skipped.
port="$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')"
"$venv/bin/nansentinel" demo --nproc 2 --steps 12 --sleep 0.3 --metrics-port "$port" \
    --report-dir "$work/reports" >"$work/demo.log" 2>&1 &
demo=$!
scraped=""
for _ in $(seq 120); do
    if scraped="$("$venv/bin/python" - "$((port + 1))" 2>/dev/null <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=2).read()
text = text.decode()
assert 'nansentinel_nonfinite_total{kind="grad"} 1.0' in text, "no drill counted yet"
print("\n".join(line for line in text.splitlines()
                if line.startswith(("nansentinel_steps_total", "nansentinel_nonfinite_total"))))
PY
)"; then
        break
    fi
    kill -0 "$demo" 2>/dev/null || break
    sleep 0.5
done
code=0
wait "$demo" || code=$?
summary="summary: 12 steps: 11 applied, 1 skipped"
if [ "$code" != 0 ] || [ -z "$scraped" ] || ! grep -q "$summary" "$work/demo.log"; then
    cat "$work/demo.log" >&2
    echo "floors lane: the demo with metrics on failed (exit $code;" \
        "scraped: ${scraped:-nothing})" >&2
    exit 1
fi
if grep -qi "numpy\|Traceback" "$work/demo.log"; then
    cat "$work/demo.log" >&2
    echo "floors lane: the demo's output is not calm (numpy or a traceback)" >&2
    exit 1
fi
echo "floors lane: demo with metrics on passed; rank 1's exporter said:"
echo "$scraped"
