"""``nansentinel files``: the operational files the package ships, written out where you say.

The Slurm batch script and its drain epilog, the torchrun wrapper, the Kubernetes examples,
and the monitoring set (Prometheus rules, Alertmanager routing, the Grafana dashboard, the
runbook) are data of this package, in the folders beside this module, so an install from an
index has them as a clone does, and the docs give one command for both::

    nansentinel files                       # the sets and their files
    nansentinel files slurm ./slurm         # write one set under a folder

A set is a folder here: what it holds is what is written, so a new file needs no table. Nothing
the user has is overwritten: when any file of the set is already there (a file, a folder, a
symlink), the command names every one of them and writes nothing; each file is then created
exclusively, so one that appears meanwhile is refused too. Scripts (a ``#!`` first line) are
written executable. Reads only the package and the standard library, like the other
torch-free commands.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from nansentinel.common.exitcodes import EXIT_CONFIG, EXIT_OK

if TYPE_CHECKING:
    from importlib.abc import Traversable  # importlib.resources.abc from Python 3.11


@dataclass(frozen=True)
class FileSet:
    """One set of shipped files: its folder in the package, what it is for, where the docs
    explain it, and what a user does next with it (``{dir}``: where it was written)."""

    name: str
    about: str
    docs: str
    then: str


#: The sets, each a folder beside this module.
SETS = {
    s.name: s for s in (
        FileSet("slurm", "the Slurm batch script and the drain program (job hook or Epilog)",
                "docs/launch.md#slurm",
                "sbatch --nodes=8 {dir}/nansentinel.sbatch train.py"),
        FileSet("torchrun", "a `torchrun` wrapper for tools that insist on calling torchrun",
                "docs/launch.md",
                "install -m 755 {dir}/torchrun-wrapper.sh ~/bin/torchrun"),
        FileSet("kubernetes", "an Indexed Job, a PodMonitor and a PrometheusRule",
                "docs/launch.md#kubernetes-untested",
                "kubectl apply -f {dir}/podmonitor.yaml -f {dir}/prometheusrule.yaml"),
        FileSet("monitoring", "Prometheus rules and config, Alertmanager routing, the Grafana "
                "dashboard and the runbook", "docs/monitoring.md",
                "promtool check config {dir}/prometheus/prometheus.yml"),
    )
}


def package_files(name: str) -> dict[str, Traversable]:
    """The files of set ``name``: path relative to the set's folder -> the packaged file."""
    found: dict[str, Traversable] = {}

    def walk(node: Traversable, prefix: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            if child.name.startswith((".", "__")):
                continue
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            else:
                found[prefix + child.name] = child

    walk(resources.files(__name__) / name, "")
    return found


def write_set(name: str, folder: Path) -> list[Path]:
    """Write set ``name`` under ``folder`` (made if missing); the paths written.

    Raises:
        FileExistsError: some of its files are already there (all of them named); nothing
            was written.
        OSError: a file could not be written (the files written before it stay).
    """
    files = package_files(name)
    taken = [folder / rel for rel in files if os.path.lexists(folder / rel)]
    if taken:
        raise FileExistsError(
            f"{len(taken)} of the {len(files)} files of set {name!r} already exist: "
            + ", ".join(map(str, taken))
            + "; nothing was written (move them away, or name another folder)")
    written = []
    for rel, source in files.items():
        target = folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        data = source.read_bytes()
        mode = 0o755 if data.startswith(b"#!") else 0o644
        # O_EXCL: a file that appeared since the check above is refused, never replaced.
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(target, mode)  # the umask may have narrowed it
        written.append(target)
    return written


def listing() -> str:
    """Every set, what it is for, and its files."""
    lines = []
    for s in SETS.values():
        lines.append(f"{s.name:<11} {s.about} ({s.docs})")
        lines += [f"{'':<11}   {rel}" for rel in package_files(s.name)]
    return "\n".join(lines) + "\n"


def files_main(argv: list[str]) -> int:
    """``nansentinel files [SET DIR]``: list the sets, or write one out."""
    parser = argparse.ArgumentParser(
        prog="nansentinel files",
        description="Write the files the package ships (Slurm script, Kubernetes examples, "
        "Prometheus rules, Alertmanager routing, Grafana dashboard, runbook) under a folder. "
        "Without arguments: list the sets and their files.",
        allow_abbrev=False,
    )
    parser.add_argument("set", nargs="?", choices=sorted(SETS), metavar="SET",
                        help=f"one of {', '.join(SETS)}")
    parser.add_argument("dir", nargs="?", metavar="DIR",
                        help="the folder to write them under (made if missing); a file "
                        "already there is never overwritten")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2
    if args.set is None:
        print(listing(), end="")
        return EXIT_OK
    if args.dir is None:
        print(f"nansentinel files: error: name the folder to write set {args.set!r} under, "
              f"e.g. nansentinel files {args.set} ./{args.set}", file=sys.stderr)
        return EXIT_CONFIG
    folder = Path(args.dir)
    try:
        written = write_set(args.set, folder)
    except OSError as exc:  # write_set's own FileExistsError names every file in its text
        what = f"{exc.filename}: {exc.strerror}" if exc.filename else exc
        print(f"nansentinel files: error: {what}", file=sys.stderr)
        return EXIT_CONFIG
    for path in written:
        print(path)
    chosen = SETS[args.set]
    print(f"nansentinel files: wrote {len(written)} files of set {args.set!r} under {folder} "
          f"({chosen.docs}); next, e.g.: {chosen.then.format(dir=folder)}", file=sys.stderr)
    return EXIT_OK
