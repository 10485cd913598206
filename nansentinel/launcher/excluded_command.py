"""``nansentinel excluded``: list the hosts the sentinel excluded, or clear one after repair.

The exclusion file outlives the job on purpose -- a launcher started later on a bad host
refuses to join -- so an operator needs a way to see why a host is out and to let it back
in once it is fixed, without editing JSON lines by hand (:mod:`nansentinel.common.exclusion` keeps
the file locked while it rewrites it). ``--hostlist`` prints the excluded hosts for ``sbatch
--exclude=`` (``--among "$SLURM_JOB_NODELIST"``: those of a job's allocation), so the next job
keeps off a bad host even after an operator resumed the node without clearing it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from nansentinel import config as _config
from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.common.exitcodes import EXIT_CONFIG, EXIT_OK
from nansentinel.common.text import printable
from nansentinel.launcher import hostlist
from nansentinel.launcher.console import exit_status, format_time


def excluded_main(argv: list[str] | None = None) -> int:
    """``nansentinel excluded``: list the excluded hosts, or clear one after repair."""
    parser = argparse.ArgumentParser(
        prog="nansentinel excluded",
        description="List the hosts the sentinel has excluded (host, step, time, job, reason, "
        "evidence), or clear a repaired host so that its launcher may join again.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--exclusion-file", "--exclusion_file", metavar="FILE",
        default=os.environ.get(_config.env_var("exclusion_file")),
        help=f"the exclusion file [env {_config.env_var('exclusion_file')}]",
    )
    parser.add_argument("--clear", metavar="HOST", action="append", default=[],
                        help="remove every record of HOST (repeatable)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the records as JSON")
    output.add_argument(
        "--hostlist", action="store_true",
        help="print the excluded hosts as one Slurm hostlist, for sbatch --exclude= (an "
        "empty line when none; names that are not plain node names are left out, with a "
        "warning)")
    parser.add_argument(
        "--among", metavar="HOSTLIST",
        help="only hosts of this Slurm hostlist, e.g. \"$SLURM_JOB_NODELIST\" (with "
        "--hostlist)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exit_status(exc)
    if args.among is not None and not args.hostlist:
        print("nansentinel excluded: error: --among needs --hostlist", file=sys.stderr)
        return EXIT_CONFIG
    if not args.exclusion_file:
        print(
            "nansentinel excluded: error: no exclusion file; pass --exclusion-file FILE or set "
            f"{_config.env_var('exclusion_file')}",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    store = ExclusionStore(args.exclusion_file)
    try:
        if args.clear:
            for host in args.clear:
                removed = store.clear(host)
                print(f"cleared {removed} exclusion record(s) of host {printable(host, 255)} "
                      f"from {store.path}")
            return EXIT_OK
        records = store.records()
    except OSError as exc:
        print(f"nansentinel excluded: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.hostlist:
        return _print_hostlist(records, args.among)
    if args.json:
        print(json.dumps([r.to_dict() for r in records], indent=2, default=str,
                         allow_nan=False))
        return EXIT_OK
    if not records:
        print(f"no excluded hosts in {store.path}")
        return EXIT_OK
    for r in records:
        job = None if r.job_id is None else printable(r.job_id, 80)
        print(f"{printable(r.host, 255)}  step {r.step}  {format_time(r.time)}  job {job}")
        print(f"    reason:   {printable(r.reason)}")
        if r.evidence:
            print(f"    evidence: {printable(_summarize(r.evidence))}")
    return EXIT_OK


def _print_hostlist(records: list[ExclusionRecord], among: str | None) -> int:
    """``--hostlist``: the excluded hosts (of ``among``, when given) as one Slurm hostlist."""
    hosts = {r.host for r in records}
    if among is not None:
        try:
            hosts &= set(hostlist.expand(among))
        except ValueError as exc:
            print(f"nansentinel excluded: error: --among: {exc}", file=sys.stderr)
            return EXIT_CONFIG
    usable = {h for h in hosts if hostlist.NODE_NAME.fullmatch(h)}
    for host in sorted(hosts - usable):
        print(f"nansentinel excluded: warning: host {printable(host, 80)!r} is not a Slurm node "
              "name; left out of the hostlist", file=sys.stderr)
    print(hostlist.compress(usable))
    return EXIT_OK


def _summarize(evidence: Mapping[str, Any], limit: int = 160) -> str:
    text = ", ".join(f"{k}={v}" for k, v in evidence.items() if v not in (None, "", [], {}))
    return text if len(text) <= limit else text[: limit - 3] + "..."
