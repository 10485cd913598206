"""The incident page: one self-contained HTML file to read an incident at a glance.

``nansentinel incidents show ID --html OUT`` writes it: the incident's facts in the words of
the CLI (incidents.py), and the loss and gradient norm of the steps before it, the blamed
rank(s) against the cluster's mean and spread, with the incident step marked. It opens from a
laptop with no network: no script, no stylesheet or font to fetch, the plot inline as SVG.

The report holds the cluster's mean and standard deviation over the ranks with a finite value
(not its median: a median needs every rank's value, which a step never gathers), so the band
is mean ± std and says so. A report without ``history`` (an older version) is drawn from the
incident step's numbers alone.

matplotlib draws (the optional extra ``nansentinel[report]``), imported here only, so the
sentinel and the CLI never need it; the figure is a plain ``matplotlib.figure.Figure``, which
leaves pyplot's global backend state alone.
"""

from __future__ import annotations

import dataclasses
import html
import io
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from nansentinel.reading.incidents import Incident, ReportError, Section, names, number

#: The signals drawn, one panel each.
SIGNALS = ("loss", "grad_norm")

_INSTALL = "pip install 'nansentinel[report]'"


@dataclasses.dataclass(frozen=True, slots=True)
class Curve:
    """One signal of one incident: the cluster's mean and std by step, each blamed rank's own
    values (NaN where a value is missing or non-finite), and the steps where it was
    non-finite."""

    steps: list[int]
    mean: list[float]
    std: list[float]
    ranks: dict[str, tuple[list[int], list[float], list[int]]]
    history: bool


def _finite(x: Any) -> float:
    v = number(x)
    return v if v is not None and math.isfinite(v) else math.nan


def _nonfinite(x: Any) -> bool:
    v = number(x)
    return v is not None and not math.isfinite(v)


def curve(incident: Incident, signal: str) -> Curve:
    """The values :func:`figure_svg` draws for ``signal``, from the report's ``history`` when
    it has one, else from the incident step's numbers."""
    r = incident.report
    hist = r.get("history")
    ranks = incident.ranks()
    blamed = [str(b) for b in incident.bad_ranks] or list(ranks)
    out: dict[str, tuple[list[int], list[float], list[int]]] = {}
    if isinstance(hist, dict) and isinstance(hist.get(signal), dict):
        steps = [int(s) for s in hist.get("steps") or []]
        series = hist[signal]
        mean = [_finite(x) for x in series.get("mean") or []][:len(steps)]
        std = [_finite(x) for x in series.get("std") or []][:len(steps)]
        for rank in blamed:
            own = (ranks.get(rank) or {}).get("history")
            if isinstance(own, dict) and own.get(signal) is not None:
                s, v = [int(x) for x in own.get("steps") or []], own[signal]
                out[rank] = (s, [_finite(x) for x in v][:len(s)],
                             [st for st, x in zip(s, v, strict=False) if _nonfinite(x)])
            else:
                out[rank] = _at_step(incident, rank, signal)
        return Curve(steps, mean, std, out, True)
    cluster = (r.get("cluster") or {}).get(signal) or {}
    for rank in blamed:
        out[rank] = _at_step(incident, rank, signal)
    return Curve([incident.step], [_finite(cluster.get("mean"))], [_finite(cluster.get("std"))],
                 out, False)


def _at_step(incident: Incident, rank: str, signal: str) -> tuple[list[int], list[float],
                                                                 list[int]]:
    """A rank's value at the incident step alone (a rank without its own history)."""
    value = (incident.ranks().get(rank) or {}).get(signal)
    return [incident.step], [_finite(value)], [incident.step] if _nonfinite(value) else []


def figure_svg(incident: Incident) -> str:
    """The two panels (loss, gradient norm) as an inline ``<svg>`` element."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError(f"--html draws with matplotlib, which is not installed: {_INSTALL}"
                          ) from None
    ranks = incident.ranks()
    fig = Figure(figsize=(9, 6.4), layout="constrained")
    axes = fig.subplots(len(SIGNALS), 1, sharex=True)
    for ax, signal in zip(axes, SIGNALS, strict=True):
        c = curve(incident, signal)
        low = [m - s if not math.isnan(s) else m for m, s in zip(c.mean, c.std, strict=False)]
        high = [m + s if not math.isnan(s) else m for m, s in zip(c.mean, c.std, strict=False)]
        style = {} if len(c.steps) > 1 else {"marker": "o"}
        ax.fill_between(c.steps[:len(low)], low, high, color="#9db4d0", alpha=0.5, lw=0,
                        label="cluster mean ± std (ranks with a finite value)")
        ax.plot(c.steps[:len(c.mean)], c.mean, color="#3b5b85", lw=1.2, label="cluster mean",
                **style)
        for n, (rank, (steps, values, bad)) in enumerate(c.ranks.items()):
            host = (ranks.get(rank) or {}).get("hostname", "?")
            color = ("#d62728", "#ff7f0e", "#9467bd", "#8c564b")[n % 4]
            ax.plot(steps, values, color=color, lw=1.4, marker=".", ms=4,
                    label=f"rank {rank} (host {host})")
            if bad:
                ax.scatter(bad, [0.97] * len(bad), transform=ax.get_xaxis_transform(),
                           marker="X", s=60, color=color, clip_on=False, zorder=5,
                           label=f"rank {rank} non-finite (nan/inf)")
                for x in bad:
                    ax.annotate("non-finite", (x, 0.97), xycoords=ax.get_xaxis_transform(),
                                xytext=(-8, 0), textcoords="offset points", ha="right",
                                va="center", fontsize=7, color=color)
        ax.axvline(incident.step, color="#d62728", ls="--", lw=1,
                   label=f"incident, step {incident.step}")
        ax.set_ylabel(signal)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1].set_xlabel("step")
    span = "the incident step only (the report has no history)" if not c.history else (
        f"steps {c.steps[0]}–{c.steps[-1]}" if c.steps else "no steps")
    fig.suptitle(f"Step {incident.step}: rank {names(incident.bad_ranks)} against the cluster, "
                 f"{span}", fontsize=10)
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "nansentinel"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]


_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 980px;
       color: #1d2733; background: #fff; }
h1 { font-size: 20px; margin-bottom: 4px; } h2 { font-size: 15px; margin: 18px 0 4px; }
.facts { background: #f5f7fa; border-left: 4px solid #d62728; padding: 8px 14px; }
ul { margin: 2px 0; padding-left: 20px; } li { margin: 2px 0; }
.plot svg { width: 100%; height: auto; } .note { color: #5a6570; }
code { font-size: 13px; }
"""


def html_page(incident: Incident, sections: list[Section]) -> str:
    """The page: a headline, the explanation's sections, the plot."""
    e = html.escape
    r = incident.report
    hosts = names(incident.bad_hosts)
    headline = (f"Incident at step {incident.step}: rank {names(incident.bad_ranks)} on host "
                f"{hosts}" if incident.bad_ranks else f"Incident at step {incident.step}")
    facts = (f"<p class='facts'><b>{e(incident.outcome)}</b> · kinds {e(names(incident.kinds))}"
             f" · verdict <b>{e(incident.verdict or 'none')}</b> · job {e(incident.job)}</p>")
    body = "\n".join(
        f"<section><h2>{e(s.title)}</h2><ul>"
        + "".join(f"<li>{e(line)}</li>" for line in s.lines) + "</ul></section>"
        for s in sections
    )
    note = "" if isinstance(r.get("history"), dict) else (
        "<p class='note'>This report has no history (written by an older nansentinel): the "
        "plot shows the incident step only.</p>")
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{e(headline)}</title><style>{_CSS}</style></head>\n"
        f"<body data-step='{incident.step}' data-ranks='{e(names(incident.bad_ranks))}' "
        f"data-hosts='{e(hosts)}'>\n<h1>{e(headline)}</h1>\n{facts}\n"
        f"<div class='plot'>{figure_svg(incident)}</div>\n{note}\n{body}\n</body></html>\n"
    )


def write(incident: Incident, sections: list[Section], out: Path) -> Path:
    """Write the page to ``out`` atomically (a temporary file linked into place), created
    0600, as reports are: the page holds hosts and parameter names. What the user did not mean
    is a :class:`ReportError` naming it, never a guess: ``out`` already there (it may be the
    user's own file: not overwritten, and not written as ``out-1`` beside it, which the user
    would not look for), a missing folder (a typo in the path, not one to create silently).
    Returns ``out``."""
    if out.exists() or out.is_symlink():
        raise ReportError(f"--html {out}: already exists; remove it or give another name")
    if not out.parent.is_dir():
        raise ReportError(f"--html {out}: no directory {out.parent}; create it first")
    try:
        page = html_page(incident, sections)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
        raise ReportError(f"{incident.path}: its curves cannot be drawn "
                          f"({type(exc).__name__}: {exc})") from None
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(page)
        os.link(tmp, out)  # fails if the name was taken meanwhile: never overwrite
    except FileExistsError:
        raise ReportError(f"--html {out}: already exists; remove it or give another name") \
            from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out
