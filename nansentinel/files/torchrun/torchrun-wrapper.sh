#!/bin/sh
# torchrun, with the nansentinel launcher in front.
#
# For clusters whose tooling insists on calling `torchrun`: install this script as
# `torchrun` earlier in PATH (or point the tool at it). Every argument goes to
# `nansentinel run`, which passes torchrun's options through unchanged, so an existing
# command line keeps working and gains per-rank failure summaries, sentinel exit codes
# and host exclusion. Sentinel options, if any, must come first.
#
# PYTHON selects the interpreter (default: python), e.g. PYTHON=/opt/venv/bin/python.
exec "${PYTHON:-python}" -m nansentinel run "$@"
