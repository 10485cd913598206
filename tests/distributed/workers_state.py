"""What the model holds (issue 68): the training loops of tests/distributed/test_state.py.

A NaN written into the model's own state (a weight, an optimizer-state tensor, a floating
buffer, a hyperparameter) on one rank or on every rank, by the ``NANSENTINEL_INJECT`` drills
(``inject=``) or by the test itself (``write=``: what a bit flip, a bad restore or a schedule
would leave), on the matrix's engines (workers_invariants.BUILDERS: DDP, FSDP2, DeepSpeed; HSDP
and ZeRO 2/3 beside them here), and what every rank made of it.

A case is a plain dict, so that the test can list them and ship them to the ranks; every rank
runs its list in one process group, one case after the other, each on a fresh model (seed 0).
``case["run"]`` picks the loop: ``train`` (the default), ``refuse`` (a checkpoint restored with
a NaN before the Sentinel is built), ``restore`` (a NaN checkpoint restored by hand mid-run,
then ``check_state()`` and ``load_state_dict``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

import nansentinel
from nansentinel.common.verdicts import outcome_from_verdicts, read_verdicts
from tests.distributed.workers_invariants import (
    BUILDERS,
    PLAIN,
    DeepSpeedRun,
    FSDPRun,
    Net,
    Run,
    _local,
    batch_for,
)

Case = dict[str, Any]


class HSDPRun(FSDPRun):
    """HSDP: ``fully_shard`` on a 2-D mesh (replicate x shard); ranks r and r + world/2 hold
    the same shard, replicas of each other."""

    _mesh: ClassVar[dict[int, Any]] = {}

    def build(self, net: Net) -> tuple[Any, torch.optim.Optimizer | None]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if self.world not in self._mesh:  # one mesh for every case (its groups are made once)
            self._mesh[self.world] = init_device_mesh(
                "cpu", (2, self.world // 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(net, mesh=self._mesh[self.world])
        return net, torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True)


class ZeroRun(DeepSpeedRun):
    """A DeepSpeed engine at ZeRO ``stage`` (the matrix's builder is ZeRO-1)."""

    stage: ClassVar[int] = 1

    def build(self, net: Net) -> tuple[Any, torch.optim.Optimizer | None]:
        import logging

        import deepspeed

        from tests.distributed.workers_deepspeed import on_cpu_gloo

        on_cpu_gloo()
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                  # ZeRO-3 partitions every parameter, however small (as a large model's)
                  "zero_optimization": {"stage": self.stage,
                                        "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True)
        engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
        return engine, None

    def state(self) -> dict[str, Any]:
        """Under ZeRO-3 the weights are partitioned: gathered whole (a collective)."""
        from tests.distributed.workers_deepspeed import full_weights

        return {"params": full_weights(self.model).double(),
                "buffers": torch.cat([b.detach().reshape(-1).double()
                                      for b in self.net.buffers() if b.is_floating_point()]),
                "optimizer": self.optimizer_state(), "scale": None}


class Zero2Run(ZeroRun):
    stage = 2


class Zero3Run(ZeroRun):
    stage = 3


#: Engine -> how to build and drive it (the matrix's builders, and HSDP and ZeRO 2/3).
RUNS: dict[str, type[Run]] = {
    "ddp": BUILDERS["DDPPath"], "fsdp2": BUILDERS["FSDPPath"], "hsdp": HSDPRun,
    "zero1": ZeroRun, "zero2": Zero2Run, "zero3": Zero3Run,
}


# --- the test's own faults -----------------------------------------------------------------


def _optimizer_states(run: Run) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the optimizer's floating state tensors this rank holds, in a
    fixed order (DeepSpeed: its torch optimizer's, over ZeRO's flat partitions)."""
    opt = run.model.basic_optimizer if run.optimizer is None else run.optimizer
    out = []
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            for key, v in sorted(opt.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim():
                    out.append((f"{g}.{i}.{key}", _local(v)))
    return out


@torch.no_grad()
def write_fault(run: Run, what: str, value: float = math.nan) -> None:
    """Write ``value`` into this rank's state, as a fault between two steps would: the last
    element of ``inp.weight`` (the drills write the first: another place), of Adam's
    ``exp_avg_sq`` of it (ZeRO's: of its flat partition), or of BatchNorm's ``running_var``
    (the drills write ``running_mean``)."""
    net = run.net
    if what == "weight":
        local = _local(net.inp.weight)
        if local.numel() == 0:  # a released ZeRO-3 parameter: its partition
            local = net.inp.weight.ds_tensor
        local.view(-1)[-1] = value
    elif what == "optimizer_state":
        t = next(t for n, t in _optimizer_states(run) if n.endswith("exp_avg_sq") and t.numel())
        t.view(-1)[-1] = value
    elif what == "buffer":
        net.norm.running_var[-1] = value
    else:
        raise ValueError(what)


def _groups(run: Run) -> list[dict[str, Any]]:
    return (run.model.optimizer if run.optimizer is None else run.optimizer).param_groups


# --- what a step and a case leave ----------------------------------------------------------


def _record(r: Any) -> dict[str, Any]:
    return {"step": r.step, "outcome": str(r.outcome), "applied": r.applied,
            "bad_ranks": list(r.bad_ranks), "bad_hosts": list(r.bad_hosts),
            "kinds": list(r.kinds), "verdict": r.verdict,
            "poisoned_state": {int(k): list(v) for k, v in r.poisoned_state.items()},
            "state_action": r.state_action, "reason": r.reason,
            "rolled_back_to": r.rolled_back_to, "injected": r.injected,
            "buffers_restored": r.buffers_restored, "excluded_hosts": list(r.excluded_hosts)}


def _error(exc: nansentinel.NonFiniteError) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc), **_record(exc.result)}


def _reports(directory: Path) -> list[Any]:
    """Rank 0's incident reports, parsed (None for one that is not valid JSON)."""
    out: list[Any] = []
    for path in sorted(directory.glob("incident-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except ValueError:
            out.append(None)
    return out


def _exit_code(run_dir: Path, rank: int) -> int | None:
    """What ``nansentinel run`` would exit with on this rank's host, from the verdicts the
    ranks left (None: none left)."""
    verdicts = read_verdicts(run_dir)
    if not verdicts:
        return None
    return outcome_from_verdicts(verdicts, f"host{rank}").exit_code


def _sentinel(run: Run, case: Case, rank: int, report_dir: Path, run_dir: Path
              ) -> nansentinel.Sentinel:
    return run.sentinel(
        report_dir=str(report_dir), run_dir=str(run_dir), env={}, hostname=f"host{rank}",
        metrics_port=0, metrics_linger=0, policy=case.get("policy", "skip"),
        spikes=case.get("spikes", "warn"), inject=case.get("inject"),
        snapshot_every=case.get("snapshot_every", 2), **case.get("config", {}))


def _combo(case: Case) -> dict[str, Any]:
    """What the builder takes: the matrix's plain setup with a BatchNorm (its floating
    buffers), and the case's ``combo`` (the optimizer, say)."""
    return dict(PLAIN, engine=case["engine"], batchnorm=True, **case.get("combo", {}))


def _finish(run: Run, sentinel: nansentinel.Sentinel | None, rank: int, out: dict[str, Any],
            report_dir: Path, run_dir: Path) -> dict[str, Any]:
    """The case's end on every rank: the state whole (collectives), rank 0's reports, the exit
    code the verdicts give."""
    if sentinel is not None:
        out["strikes"] = sentinel.state_dict()["strikes"]
        sentinel.close()
    out["state"] = run.state()
    out["exit_code"] = _exit_code(run_dir, rank)
    if rank == 0:
        out["reports"] = _reports(report_dir)
    return out


# --- the loops -----------------------------------------------------------------------------


def train(rank: int, world: int, case: Case, report_dir: Path, run_dir: Path
          ) -> dict[str, Any]:
    """Train ``case["steps"]`` steps with the case's faults: ``write`` maps a step to
    ``{"what": kind, "ranks": [..] (None: every rank)}``, written as the step begins (before
    its batch); ``lr_nan_from``: the loop's schedule returns NaN from that step on."""
    run = RUNS[case["engine"]](_combo(case), rank, world)
    sentinel = _sentinel(run, case, rank, report_dir, run_dir)
    groups = _groups(run)
    base = groups[0]["lr"]
    results: list[Any] = []
    error = None
    try:
        for step in range(case["steps"]):
            groups[0]["lr"] = math.nan if step >= case.get("lr_nan_from", 10**9) else base
            fault = case.get("write", {}).get(step)
            if fault is not None and (fault["ranks"] is None or rank in fault["ranks"]):
                write_fault(run, fault["what"])
            batch = sentinel.check_batch(batch_for(rank, step, 0))
            loss = run.loss(batch)
            sentinel.check_loss(loss)
            run.backward(loss)
            run.reduce(sentinel)
            results.append(sentinel.step())
            run.zero_grad()
    except nansentinel.NonFiniteError as exc:
        error = _error(exc)
    out = {"error": error, "lr": [g["lr"] for g in groups], "base_lr": base,
           "gate": "device" if sentinel.device_gate is not None else "host"}
    out = _finish(run, sentinel, rank, out, report_dir, run_dir)
    # Read once every step is decided (the device gate decides a step at the next call).
    out["records"] = []
    for r in results:
        try:
            out["records"].append(_record(r))
        except nansentinel.NonFiniteError:  # a device-gated step whose decision stopped it
            assert error is not None and error["step"] == r.step
    return out


def refuse(rank: int, world: int, case: Case, report_dir: Path, run_dir: Path
           ) -> dict[str, Any]:
    """A checkpoint restored with a NaN (``case["what"]`` on ``case["ranks"]``, None: every
    rank) before the Sentinel is built: its construction raises on every rank."""
    run = RUNS[case["engine"]](_combo(case), rank, world)
    if case["ranks"] is None or rank in case["ranks"]:
        write_fault(run, case["what"])
    error = None
    try:
        sentinel = _sentinel(run, case, rank, report_dir, run_dir)
    except nansentinel.NonFiniteError as exc:
        error = _error(exc)
    else:
        sentinel.close()
    return {"error": error, "exit_code": _exit_code(run_dir, rank)}


def restore(rank: int, world: int, case: Case, report_dir: Path, run_dir: Path
            ) -> dict[str, Any]:
    """Two healthy steps and a checkpoint (model, optimizer, sentinel); one more step; then the
    checkpoint restored by hand with a NaN in it (``case["what"]`` on ``case["ranks"]``),
    ``check_state()`` and ``load_state_dict``; then the clean checkpoint restored, checked,
    and one more step."""
    import copy

    run = RUNS[case["engine"]](_combo(case), rank, world)
    sentinel = _sentinel(run, case, rank, report_dir, run_dir)
    assert run.optimizer is not None
    records: list[dict[str, Any]] = []

    def step(index: int) -> None:
        batch = sentinel.check_batch(batch_for(rank, index, 0))
        loss = run.loss(batch)
        sentinel.check_loss(loss)
        run.backward(loss)
        records.append(_record(sentinel.step()))
        run.zero_grad()

    step(0)
    step(1)
    saved = copy.deepcopy({"model": run.net.state_dict(), "optimizer": run.optimizer.state_dict(),
                           "sentinel": sentinel.state_dict()})
    step(2)
    said: dict[str, Any] = {}

    def load(poisoned: bool) -> None:
        # A copy: load_state_dict keeps the optimizer's tensors as given (no copy on the same
        # device), and the fault below must not reach the checkpoint itself.
        run.net.load_state_dict(copy.deepcopy(saved["model"]))
        run.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
        if poisoned and (case["ranks"] is None or rank in case["ranks"]):
            write_fault(run, case["what"])

    for how in ("check_state", "load_state_dict"):
        load(poisoned=True)
        try:
            if how == "check_state":
                sentinel.check_state()
            else:
                sentinel.load_state_dict(saved["sentinel"])
            said[how] = None
        except nansentinel.NonFiniteError as exc:  # every rank's verdict is left by now
            said[how] = {**_error(exc), "exit_code": _exit_code(run_dir, rank)}
    load(poisoned=False)
    sentinel.load_state_dict(saved["sentinel"])  # finite: taken, and the run goes on
    step(2)
    out = {"records": records, "said": said, "step_after": sentinel.step_index}
    return _finish(run, sentinel, rank, out, report_dir, run_dir)


LOOPS = {"train": train, "refuse": refuse, "restore": restore}


def run_cases(rank: int, world: int, *, cases: list[Case], report_dir: str,
              run_dir: str) -> list[dict[str, Any]]:
    """Every case in turn, in this process group; each case's reports and verdicts in their
    own directories."""
    outs = []
    for i, case in enumerate(cases):
        reports, runs = Path(report_dir) / str(i), Path(run_dir) / str(i)
        runs.mkdir(parents=True, exist_ok=True)
        outs.append(LOOPS[case.get("run", "train")](rank, world, case, reports, runs))
        dist.barrier()
    return outs
