"""Sentinel configuration: one validated dataclass, one precedence rule.

Precedence, written once here and tested once: keyword argument > ``NANSENTINEL_*``
environment variable > default. The environment exists so that a launcher (``nansentinel
run``), a Slurm script or a Kubernetes manifest can configure every rank without touching
the training script; the keyword exists so that the script can pin what it depends on.

Every bad value is a :class:`ConfigError` (a ``ValueError``) whose message names the field or
the environment variable, the value, and what would have been accepted.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import socket
from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin

from nansentinel.common import doors
from nansentinel.result import NanSentinelError

log = logging.getLogger("nansentinel")

#: Every setting is also an environment variable: field ``metrics_port`` is
#: ``NANSENTINEL_METRICS_PORT`` (:func:`env_var`), as torchrun derives ``PET_*`` from its options.
ENV_PREFIX = "NANSENTINEL_"
#: Kubernetes downward API convention (DCGM's exporter reads the same variable).
ENV_NODE_NAME = "NODE_NAME"

Policy = Literal["skip", "abort", "rollback", "drop"]
SpikeAction = Literal["warn", "skip", "rollback"]
Gate = Literal["auto", "device", "host"]
DivergenceAction = Literal["repair", "abort", "warn"]
SpikePreset = Literal["warn", "recover"]
CollapseAction = Literal["warn", "skip", "rollback"]
SPIKE_PRESETS: dict[str, dict[str, Any]] = {
    # Today's behaviour: spikes are reported (incident, metrics) and the step applied.
    "warn": {},
    # The field's playbook, as bench/recovery.py measured it best (docs/recovery.md): a
    # language model's loss cannot jump 10x (cross-entropy starts near ln V), so 1.5x its
    # running median (and 6 sigma) is a spike; one spiking step is skipped, two in a row roll
    # back to the last snapshot (every 5 quiet steps, taken before the update) with the
    # learning rate halved and the batches that led in discarded (twice as many on a repeat);
    # up to 10 rollbacks to one snapshot before the run stops.
    "recover": {
        "loss_spike_action": "rollback", "grad_spike_action": "rollback",
        "loss_spike_ratio": 1.5, "spike_patience": 2, "spike_warmup": 10,
        "snapshot_every": 5, "max_rollbacks": 10,
        # issue 52: no update at a learning rate that was never known to work (the cap after
        # a rollback, a jump held, the backoff over after 20 clean steps, clean snapshots).
        "rollback_lr_cap": True, "lr_jump_ratio": 4.0, "rollback_lr_quiet_steps": 20,
        "rollback_clean_snapshots": True,
        # issue 60: a rollback that does not bring the loss back within 5 steps is not
        # repeated to the same snapshot, and a recovery leaves at most 60 steps unapplied.
        "rollback_check_steps": 5, "max_lost_steps": 60, "snapshot_keep": 2,
        # issue 70: a collapse's stretch that leaves the run worse than it went in is rolled
        # back over at its end.
        "collapse_action": "rollback",
    },
}
DEFAULT_METRICS_PORT = 9410
DEFAULT_REPORT_DIR = "nansentinel_reports"
#: The largest value of a numeric setting whose rule names none (steps, counts): a 32-bit
#: signed integer, or 1e9 for a float. A value past a maximum is a typo or a probe, never a
#: run: an infinite timeout hangs the watchdog's fit, an infinite linger overflows
#: ``time.sleep``, a window of 10**40 overflows ``deque``.
INT_MAX = 2**31 - 1
FLOAT_MAX = 1e9


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """What a field's value must be, beside its type (the annotation, checked first): kept in
    the field's metadata (:func:`rule`) and checked for every field by one loop
    (:func:`_check_rules`), so that a field's bounds live in its declaration alone.

    A ``Literal`` annotation's choices are the field's choices; ``what`` names them in the
    message ("a gate"), or, for a string, asks it to be non-empty ("a non-empty path").
    Numbers are finite, at least ``minimum`` (or above ``above``), below ``below`` and at most
    ``maximum`` (:data:`INT_MAX`/:data:`FLOAT_MAX` when not given); ``off`` is a value taken
    outside the bounds that turns the setting off; ``unit`` and ``why`` end the message.
    """

    minimum: float | None = None
    above: float | None = None
    below: float | None = None
    maximum: float | None = None
    off: float | None = None
    unit: str = ""
    what: str = ""
    why: str = ""

    def problem(self, name: str, value: Any, hint: Any) -> str | None:
        """Why ``value`` breaks the rule of field ``name`` (annotated ``hint``), or None. The
        message starts ``name=value`` (:class:`ConfigError` reads the field from it)."""
        given = f"{name}={shown(value)}"
        choices = next((get_args(a) for a in (hint, *get_args(hint))
                        if get_origin(a) is Literal), None)
        if choices is not None:
            if value in choices:
                return None
            return f"{given} is not {self.what}; expected one of {', '.join(choices)}"
        if isinstance(value, str):
            return f"{given} must be {self.what}" if self.what and not value else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None  # None where the annotation allows it
        if isinstance(value, float) and not math.isfinite(value):
            return f"{given} must be a finite number"
        top = self.maximum if self.maximum is not None else (
            INT_MAX if isinstance(value, int) and hint is int else FLOAT_MAX)
        if value > top:
            return f"{given} is above its maximum, {top:g}"
        if value == self.off:
            return None
        low = ((self.minimum is not None and value < self.minimum)
               or (self.above is not None and not value > self.above)
               or (self.below is not None and not value < self.below))
        if not low:
            return None
        bounds = " and ".join(
            f"{sign} {bound:g}" for sign, bound in ((">=", self.minimum), (">", self.above),
                                                    ("<", self.below))
            if bound is not None)
        off = f"{self.off:g} (off) or " if self.off is not None else ""
        unit = f" {self.unit}" if self.unit else ""
        why = f": {self.why}" if self.why else ""
        return f"{given} must be {off}{bounds}{unit}{why}"


def rule(**bounds: Any) -> dict[str, Rule]:
    """A field's metadata holding its :class:`Rule`."""
    return {"rule": Rule(**bounds)}


class ConfigError(NanSentinelError, ValueError):
    """A configuration value is wrong; the message names the field or variable.

    ``field`` is the field at fault: given, or read from the message, which by convention
    starts with ``field=value``. :meth:`SentinelConfig.from_env` uses it to name the
    environment variable a bad value came from.
    """

    def __init__(
        self, message: str, field: str | None = None, related: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        prefix = message.split("=", 1)[0]
        self.field = field or (prefix if prefix.isidentifier() else None)
        #: Other fields the message is about (a bound between two fields).
        self.related = related


@dataclasses.dataclass(kw_only=True, slots=True)
class SentinelConfig:
    """What the sentinel does on a non-finite step, and where it reports.

    Build it with :meth:`from_env` to get the documented precedence; constructing it directly
    uses only the keywords and the defaults.
    """

    policy: Policy = dataclasses.field(default="skip", metadata=rule(what="a known policy"))
    """``skip``: no rank applies the step, gradients are discarded; ``abort``: every rank
    raises :class:`nansentinel.NonFiniteError` at the same step; ``rollback``: every rank
    restores the last-good snapshot, lowers the learning rate and skips ahead; ``drop``: the
    step is applied from the other ranks' gradients when the poisoned ranks' batch or loss was
    non-finite before their gradients left and they are at most ``max_dropped`` (drop.py),
    else skipped as under ``skip``."""

    max_dropped: float = dataclasses.field(default=0.125, metadata=rule(
        above=0, below=1,
        why="a fraction of the data-parallel ranks (at least one rank is always droppable)"))
    """Under ``policy="drop"``: the largest fraction of the data-parallel ranks whose
    contribution one step may leave out (at least one rank). More poisoned ranks than that
    point at a cause that is not local, so the step is skipped instead."""

    report_dir: str = dataclasses.field(
        default=DEFAULT_REPORT_DIR, metadata=rule(what="a non-empty path"))
    """Directory for incident reports (JSON) and the saved offending batch."""

    max_consecutive_skips: int = dataclasses.field(
        default=5, metadata=rule(minimum=1, maximum=1_000_000))
    """After this many skipped steps in a row the skip policy escalates to abort: a run that
    skips every step is not training, and the operator should know. A ``skip`` spike action
    stops after this many spiking steps in a row instead (the next applies and the spike
    references restart; ``policy="abort"``: abort): a skipped step changes nothing, so a
    level the run has left would be skipped to the end (issue 60)."""

    hostname: str | None = dataclasses.field(default=None, metadata=rule(what="a non-empty string"))
    """Host identity used in blame, reports and metrics. ``None`` means: ``NODE_NAME``
    (Kubernetes downward API), else the machine's hostname."""

    inject: str | None = None
    """Fire-drill fault spec, e.g. ``kind=grad,rank=2,step=5,value=nan`` (see inject.py)."""

    metrics_port: int = dataclasses.field(
        default=DEFAULT_METRICS_PORT, metadata=rule(minimum=0, maximum=65535))
    """Base port of the per-rank Prometheus exporter; the rank serves on base + LOCAL_RANK.
    0 disables the exporter."""

    metrics_addr: str = ""
    """Address the exporter binds; empty means all interfaces."""

    metrics_certfile: str | None = None
    """TLS certificate for the exporter (both certfile and keyfile, or neither)."""

    metrics_keyfile: str | None = None
    """TLS private key for the exporter."""

    metrics_linger: float = dataclasses.field(
        default=20.0, metadata=rule(minimum=0, maximum=3600, unit="seconds"))
    """Seconds the exporter stays up after the sentinel stops the run (abort or exclusion),
    so that Prometheus scrapes the final state and the page fires; longer than the scrape
    interval (15 s in the shipped prometheus.yml). Only applies while the exporter is on."""

    host_strikes: int = dataclasses.field(default=3, metadata=rule(minimum=1, maximum=1_000_000))
    """A host blamed this many times within ``strike_window`` steps is excluded."""

    strike_window: int = dataclasses.field(default=100, metadata=rule(minimum=1))
    """Window, in steps, over which host strikes are counted."""

    exchange_timeout: float = dataclasses.field(
        default=300.0, metadata=rule(above=0, maximum=86400, unit="seconds"))
    """Seconds a rank waits for the others at the health exchange before it names the ranks
    that did not answer and raises, so that a dead or frozen rank never hangs the job."""

    exclusion_file: str | None = None
    """Where host exclusions are recorded for the launcher (JSON lines); None: not recorded."""

    job_id: str | None = None
    """Job identity written into reports; None: ``TORCHELASTIC_RUN_ID`` when set."""

    run_dir: str | None = None
    """Directory shared with the ``nansentinel run`` launcher for per-rank verdicts."""

    loss_spike_action: SpikeAction = dataclasses.field(
        default="warn", metadata=rule(what="a spike action"))
    """On a loss spike: ``warn`` (report, apply), ``skip`` the step, or ``rollback``."""

    grad_spike_action: SpikeAction = dataclasses.field(
        default="warn", metadata=rule(what="a spike action"))
    """On a gradient-norm spike: ``warn``, ``skip`` or ``rollback``."""

    spikes: SpikePreset = dataclasses.field(default="warn", metadata=rule(what="a spike preset"))
    """What to do about loss and gradient-norm spikes, as one setting: ``warn`` (report them,
    apply the step: the fields below as they are) or ``recover`` (roll back on a spike, with
    the fields of ``SPIKE_PRESETS["recover"]``). A field given by keyword or by its own
    variable wins over the preset."""

    spike_ratio: float = dataclasses.field(default=10.0, metadata=rule(above=1, maximum=1e6))
    """A value spikes at this multiple of its rolling median (and ``spike_zscore``)."""

    loss_spike_ratio: float | None = dataclasses.field(
        default=None, metadata=rule(above=1, maximum=1e6))
    """The loss's own ``spike_ratio`` (None: ``spike_ratio``). A language model's loss starts
    near ln V and cannot jump 10x: 1.5-3x is already ruin there."""

    spike_patience: int = dataclasses.field(default=1, metadata=rule(minimum=1, maximum=1_000_000))
    """Spiking steps in a row before a ``rollback`` spike action rolls back; the ones before
    it are skipped. 2 lets one noisy step or bad batch cost a skip, not a rollback."""

    spike_zscore: float = dataclasses.field(default=6.0, metadata=rule(above=0, maximum=1e6))
    """... and at this robust z-score (distance from the median in 1.4826 x MAD units)."""

    spike_window: int = dataclasses.field(default=100, metadata=rule(minimum=3, maximum=1_000_000))
    """Values per rank in the rolling reference."""

    spike_warmup: int = dataclasses.field(default=20, metadata=rule(minimum=1, maximum=1_000_000))
    """Values needed before a series is judged."""

    snapshot_every: int = dataclasses.field(default=50, metadata=rule(minimum=1))
    """Healthy steps between last-good snapshots (kept only when a rollback is possible)."""

    rollback_lr_factor: float = dataclasses.field(default=0.5, metadata=rule(above=0, maximum=1))
    """Learning-rate multiplier after a rollback (compounds on repeated rollbacks)."""

    rollback_lr_steps: int = dataclasses.field(default=500, metadata=rule(minimum=0))
    """Steps the lowered learning rate stays in force."""

    rollback_skip_batches: int = dataclasses.field(
        default=10, metadata=rule(minimum=0, maximum=1_000_000))
    """Batches discarded after a rollback (PaLM's remedy: step past the data that led in),
    doubled on each further rollback to the same snapshot."""

    max_rollbacks: int = dataclasses.field(default=3, metadata=rule(minimum=1, maximum=1000))
    """Rollbacks to the same snapshot before the run aborts: it keeps diverging there."""

    # --- the learning rate after a rollback and at a jump (issue 52, docs/recovery.md) -------
    rollback_lr_cap: bool = False
    """After a rollback, each param group steps at most at the learning rate its restored
    snapshot was trained at (x ``rollback_lr_factor``), whatever the schedule writes, until the
    backoff ends; where the rate rose between the snapshot and the spike, at most
    ``rollback_lr_factor`` x the highest rate applied since (the rise is suspect).
    ``spikes="recover"``: True."""

    lr_jump_ratio: float = dataclasses.field(default=0.0, metadata=rule(above=1, off=0))
    """A param group asking more than this multiple of the highest learning rate it has applied
    so far steps at its last applied rate instead (held: a log line, a report, the
    ``nansentinel_lr_held_steps_total`` metric); 0: off. ``spikes="recover"``: 4."""

    lr_jump_reset: bool = False
    """Loading the sentinel's ``state_dict`` drops the checkpoint's learning-rate reference: a
    deliberate change of the learning rate on resume is taken, not held."""

    rollback_lr_quiet_steps: int = dataclasses.field(default=0, metadata=rule(minimum=0))
    """The backoff after a rollback ends once this many applied steps in a row were quiet, under
    the known-good learning rate and no larger an update than a known-good one (at the latest
    after ``rollback_lr_steps``); 0: it lasts ``rollback_lr_steps``. ``spikes="recover"``: 20."""

    rollback_clean_snapshots: bool = False
    """During the backoff, a snapshot is kept only after a clean step (quiet, the schedule under
    the known-good rate, no group held, a normal update): a state damaged just after a rollback
    is never kept as good. ``spikes="recover"``: True."""

    # --- collapses and the bounds of a recovery (issue 60, docs/recovery.md) ----------------
    collapse_action: CollapseAction = dataclasses.field(
        default="warn", metadata=rule(what="a collapse action"))
    """What a collapse (the cluster mean's loss or gradient norm far below its running level:
    degenerate data) does besides being reported: ``warn`` (the step applies; no snapshot is
    kept while it lasts), ``skip``, or ``rollback``: the stretch it marks (from the step the
    loss left its band) is judged when real data returns, and rolled back over when the loss
    comes back worse than the level before it. ``spikes="recover"``: ``rollback``."""

    rollback_check_steps: int = dataclasses.field(default=0, metadata=rule(minimum=0))
    """After a rollback, the cluster's loss must come back into its normal band (the level
    saved with the snapshot) within this many steps; if it does not, that snapshot is not
    restored again, and the next spike that would roll back to it ends the recovery instead
    (the steps apply, the references restart; ``policy="abort"``: abort). 0: not checked.
    ``spikes="recover"``: 5."""

    snapshot_keep: int = dataclasses.field(default=1, metadata=rule(minimum=1))
    """Snapshots kept in host memory (each a full one): a rollback whose snapshot did not
    bring the loss back (``rollback_check_steps``) goes on to the older one.
    ``spikes="recover"``: 2."""

    max_lost_steps: int = dataclasses.field(default=0, metadata=rule(minimum=0))
    """The most steps one recovery may leave unapplied (skipped, rolled back over, discarded
    after a rollback) before it ends the same way; a recovery ends when a new snapshot is
    kept. 0: no bound. ``spikes="recover"``: 60."""

    replay: bool = True
    """After a detection, replay the batch to tell data, host and transient faults apart
    (needs ``Sentinel(..., replay=fn)``)."""

    replay_anomaly: bool = False
    """Run the replay under ``torch.autograd.set_detect_anomaly`` to name the operation."""

    gate: Gate = dataclasses.field(default="auto", metadata=rule(what="a gate"))
    """Where a poisoned step is skipped, and when the host reads the cluster's totals.
    ``auto`` (the default): on CUDA, where the optimizer can skip on the device (torch's fused
    Adam, AdamW, Adagrad, SGD) and the gradient path allows it (DDP, FSDP2, the local path;
    not DeepSpeed, pipelines, a GradScaler, ``policy="drop"`` or a spike action that skips),
    ``step()`` launches ``optimizer.step()`` gated by a ``found_inf`` taken on the device, then
    reads the totals and decides, so the GPU runs the optimizer while the host waits for the
    end of backward; the result and an abort are the host gate's, in the same call.
    Elsewhere it is ``host``, and rank 0 says why once at construction. ``host``: one host
    read of the totals before the optimizer step (on CUDA it idles the GPU while the host
    decides: 1.040 of a 625 M bf16 step on an H200, against 1.023 for the device gate, issue
    46). ``device``: the device gate with the decision left to the next sentinel call;
    ``step()`` returns a ``PendingResult`` whose flagged fields raise ``ResultPending`` until
    then (a read never runs a collective)."""

    quarantine_size: int = dataclasses.field(
        default=64, metadata=rule(minimum=1, maximum=1_000_000))
    """Most batches kept in the quarantine (verdict ``data``); one more drops the oldest."""

    quarantine_steps: int = dataclasses.field(default=100_000, metadata=rule(minimum=1))
    """Steps after its verdict a quarantined batch is still recognised and skipped."""

    skip_list: str | None = None
    """The job's skip list (JSON lines of sample ids, see ``nansentinel.skip_list``); None:
    ``skip-list-<job>.jsonl`` in ``report_dir``. Written only when ``check_batch`` got ids."""

    save_batches: bool = True
    """Save the poisoned rank's batch next to the incident report (``torch.save``) so the
    incident can be reproduced. The batch is the user's training data: files are created
    0600 in 0700 directories; False keeps it off disk (the report says so)."""

    fingerprint_every: int = dataclasses.field(default=200, metadata=rule(minimum=0))
    """Steps between two replica fingerprint checks (replicas.py): after the optimizer step
    every replica (DDP ranks, an HSDP replicate group) must hold bit-identical weights and
    optimizer state, so a difference is silent data corruption. 0 disables the check."""

    divergence_action: DivergenceAction = dataclasses.field(
        default="repair", metadata=rule(what="an action"))
    """When replicas diverged: ``repair`` (overwrite the diverged ones from a majority rank of
    their group, in process, and strike the host; without a majority: abort), ``abort``, or
    ``warn``."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check_rules(self)
        _check_paths(self)
        if (self.metrics_certfile is None) != (self.metrics_keyfile is None):
            raise ConfigError(
                "metrics_certfile and metrics_keyfile must be given together "
                f"(certfile={shown(self.metrics_certfile)}, keyfile={shown(self.metrics_keyfile)})",
                field="metrics_certfile" if self.metrics_certfile else "metrics_keyfile",
                related=("metrics_certfile", "metrics_keyfile"),
            )
        if self.spike_warmup > self.spike_window:
            raise ConfigError(
                f"spike_warmup={self.spike_warmup} must not exceed "
                f"spike_window={self.spike_window}",
                related=("spike_window",),
            )
        if self.inject is not None:
            from nansentinel.common.inject import parse_inject  # local: inject imports config
            try:
                parse_inject(self.inject)
            except ValueError as exc:
                raise ConfigError(f"inject={shown(self.inject)}: {str(exc)[:300]}") from None

    @property
    def rolls_back(self) -> bool:
        """Some rule may roll back (the policy, a spike action or the collapse action): the
        snapshots are kept, and a gradient path that cannot restore one refuses the config."""
        return "rollback" in (self.policy, self.loss_spike_action, self.grad_spike_action,
                              self.collapse_action)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, **overrides: Any
    ) -> SentinelConfig:
        """Build a config: keyword ``overrides`` > ``NANSENTINEL_*`` in ``env`` > defaults.

        Args:
            env: the environment to read (``os.environ`` when None); injected for tests.
            overrides: field values; an unknown field name is a :class:`ConfigError`.
        """
        env = os.environ if env is None else env
        if not doors.conforms(env, Mapping[str, str]):
            bad = next(((k, v) for k, v in env.items() if not isinstance(k, str)
                        or not isinstance(v, str)), None) if isinstance(env, Mapping) else None
            raise ConfigError(
                f"env= holds {shown(bad[0], 40)}: {shown(bad[1], 40)} "
                f"({doors.given(bad[0])} to {doors.given(bad[1])}), not strings "
                "to strings" if bad else doors.refusal("env", env, Mapping[str, str])
                or "", "env")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            hints = [
                f"{u!r}" + _did_you_mean(u, names) for u in unknown
            ]
            raise ConfigError(f"unknown SentinelConfig field(s): {', '.join(hints)}")
        for key in env:
            if key.startswith("NANSENTINEL_") and key not in KNOWN_ENV:
                log.warning(
                    "environment variable %s is not read by nansentinel%s",
                    key,
                    _did_you_mean(key, KNOWN_ENV),
                )
        values: dict[str, Any] = {}
        for name, kind in _PARSERS.items():
            var = env_var(name)
            raw = env.get(var)
            if raw is None or name in overrides:
                continue
            values[name] = _parse_env(var, raw, kind)
        values.update(overrides)
        for name, value in SPIKE_PRESETS.get(values.get("spikes", "warn"), {}).items():
            values.setdefault(name, value)  # keyword > its own variable > the preset
        try:
            return cls(**values)
        except ConfigError as exc:
            # Name the variable a bad value came from: the field at fault if its value came
            # from the environment, else (a bound between two fields) the other one's.
            from_env = [
                env_var(f) for f in (exc.field, *exc.related)
                if f in _PARSERS and f in values and f not in overrides
            ]
            if from_env:
                raise ConfigError(
                    f"{exc} (from environment variable {from_env[0]})", exc.field, exc.related
                ) from None
            raise


def _parser_of(annotation: object) -> str:
    """How a field's environment variable is parsed, from the field's own annotation."""
    head = str(annotation).split("|")[0].strip()
    choices = globals().get(head)  # a Literal alias of this module: its choices are strings
    if get_origin(choices) is Literal and all(isinstance(c, str) for c in get_args(choices)):
        return "str"
    if head not in ("str", "int", "float", "bool"):
        raise TypeError(f"SentinelConfig: no environment parser for a {annotation!r} field")
    return head


#: Each field's type, from its annotation: what :func:`_check_types` holds every value to.
_HINTS: dict[str, Any] = doors.hints(SentinelConfig)
#: Each field's :class:`Rule`, from its metadata (an empty rule where it declares none).
_RULES: dict[str, Rule] = {
    f.name: f.metadata.get("rule", Rule()) for f in dataclasses.fields(SentinelConfig)}
#: The fields that name a file or a directory: an ``os.PathLike`` is taken as its string.
PATH_FIELDS = frozenset({"report_dir", "exclusion_file", "run_dir", "skip_list",
                         "metrics_certfile", "metrics_keyfile"})


#: The path fields that name a directory, and those that name a file the package reads.
DIRECTORY_FIELDS = ("report_dir", "run_dir")
FILE_FIELDS = ("exclusion_file", "skip_list", "metrics_certfile", "metrics_keyfile")


def _check_paths(cfg: SentinelConfig) -> None:
    """A directory field that names a file (or lies under one), or a file field that names a
    FIFO, a device or a directory, is refused now, naming the field (and so its variable),
    instead of failing later as an OSError from ``close()`` or blocking on a FIFO."""
    for name in (*DIRECTORY_FIELDS, *FILE_FIELDS):
        where = getattr(cfg, name)
        if not where:
            continue
        if name in FILE_FIELDS and os.path.lexists(where) and not os.path.isfile(where):
            raise ConfigError(f"{name}={shown(where, 200)} exists and is not a regular file (a "
                              "FIFO would block, a device never ends); give the path of a file",
                              name)
        directory = where if name in DIRECTORY_FIELDS else os.path.dirname(where)
        existing = _first_existing(directory or ".")
        if not os.path.isdir(existing):
            raise ConfigError(f"{name}={shown(where, 200)}: {shown(existing, 200)} exists and is "
                              "not a directory; give a path under a directory", name)


def _first_existing(path: str) -> str:
    """``path`` or the nearest of its ancestors that exists."""
    while not os.path.lexists(path):
        parent = os.path.dirname(path.rstrip(os.sep)) or "."
        if parent == path:
            break
        path = parent
    return path


def _check_types(cfg: SentinelConfig) -> None:
    """Every field holds the type its annotation says, checked in one place from the
    annotations (a field added later is checked too): a wrong type is a :class:`ConfigError`
    naming the field, the type given and the type wanted, before any range or choice is
    compared (``spikes=[]`` would otherwise fail inside a ``dict`` lookup)."""
    for name, hint in _HINTS.items():
        value = getattr(cfg, name)
        if name in PATH_FIELDS and isinstance(value, os.PathLike):
            value = os.fspath(value)
            setattr(cfg, name, value)
        problem = doors.refusal(name, value, hint, choices=False)
        if problem is not None:
            raise ConfigError(problem, name)


#: Field name -> parser (``str``, ``int``, ``float``, ``bool``), read from the dataclass.
_PARSERS: dict[str, str] = {
    f.name: _parser_of(f.type) for f in dataclasses.fields(SentinelConfig)
}


def env_var(field: str) -> str:
    """The environment variable that sets config field ``field``: ``NANSENTINEL_{FIELD}``."""
    if field not in _PARSERS:
        raise KeyError(f"SentinelConfig has no field {field!r}{_did_you_mean(field, _PARSERS)}")
    return ENV_PREFIX + field.upper()


#: The names of every SentinelConfig field.
KNOWN_FIELDS = frozenset(_PARSERS)
#: Every NANSENTINEL_* variable this package reads; anything else is probably a typo.
KNOWN_ENV = frozenset(env_var(name) for name in _PARSERS)


def resolve_hostname(configured: str | None, env: Mapping[str, str] | None = None) -> str:
    """Host identity: the configured name, else ``NODE_NAME``, else ``socket.gethostname()``.

    ``NANSENTINEL_HOSTNAME`` reaches here as ``configured`` through :meth:`from_env`.
    """
    env = os.environ if env is None else env
    return configured or env.get(ENV_NODE_NAME) or socket.gethostname()


def _parse_env(var: str, raw: str, kind: str) -> Any:
    value = raw.strip()
    if kind == "str":
        if not value:
            raise ConfigError(
                f"environment variable {var} is set but empty; unset it or give a value"
            )
        return value
    if kind == "bool":
        lowered = value.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(
            f"environment variable {var}={shown(raw)} is not a boolean (1/0, true/false)")
    try:
        return int(value) if kind == "int" else float(value)
    except ValueError:
        raise ConfigError(
            f"environment variable {var}={shown(raw)} is not a valid {kind}"
        ) from None


def maximum(field: str) -> float:
    """The largest value numeric setting ``field`` accepts (docs/configuration.md, "Ranges")."""
    top = _RULES[field].maximum
    if top is not None:
        return top
    return FLOAT_MAX if _PARSERS.get(field) == "float" else INT_MAX


def _check_rules(cfg: SentinelConfig) -> None:
    """Every field's :class:`Rule` (its metadata), in one loop: a field added later is held to
    the rule it declares, and a field without one to its type's maximum."""
    for name, field_rule in _RULES.items():
        problem = field_rule.problem(name, getattr(cfg, name), _HINTS[name])
        if problem is not None:
            raise ConfigError(problem, name)


def shown(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: a message names the value, but a
    5000-digit one would bury the rest of the message."""
    if isinstance(value, int) and value.bit_length() > 4 * limit:  # repr refuses 4,300 digits
        return f"<an integer of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def _did_you_mean(word: str, choices: object) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)  # type: ignore[call-overload]
    return f" (did you mean {close[0]}?)" if close else ""
