"""Nothing lost, nothing raised (issue 26), in one process: the rare path never breaks the job
it guards. Each test here failed on the main branch before the fix it names."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nansentinel
from nansentinel.checks import quarantine
from nansentinel.common import verdicts
from nansentinel.effects.recovery import MemorySnapshots
from nansentinel.rare import replay
from nansentinel.wire.context import Watched


def _loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (module(batch["x"]) - batch["y"]).pow(2).mean()


def _batch(seed: int, nan: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=g)
    if nan:
        x[2, 1] = math.nan
    return {"x": x, "y": torch.ones(8, 1)}


def _step(sentinel: nansentinel.Sentinel, model: nn.Module, batch: dict[str, torch.Tensor],
          scaler: Any = None, clip: bool = False) -> nansentinel.StepResult:
    batch = sentinel.check_batch(batch)
    loss = _loss(model, batch)
    sentinel.check_loss(loss)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if clip:
        scaler.unscale_(sentinel.optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    result = sentinel.step()
    sentinel.optimizer.zero_grad(set_to_none=True)
    return result


def _net(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 8)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(8))
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(8, 1))


def test_a_nan_batch_with_a_replay_is_reported_not_raised(tmp_path: Path) -> None:
    """Item 1: the quarantine signature of a NaN batch holds NaN sums; the report's JSON
    write failed with "Out of range float values" and the exception left step()."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = nansentinel.Sentinel(model, opt, replay=_loss, report_dir=str(tmp_path), env={},
                             metrics_port=0)
    r = _step(s, model, _batch(1, nan=True))
    assert not r.applied and r.verdict == "data" and r.report_path
    report = json.loads(Path(r.report_path).read_text())
    stats = report["poisoned"][0]["signature"]["stats"]
    assert "nan" in stats  # JSON has no NaN: the string stands for it
    assert _step(s, model, _batch(2)).applied
    # The same batch comes round: recognised from the signature read back from JSON.
    again = _step(s, model, _batch(1, nan=True))
    assert again.quarantined and not again.applied


def test_the_amp_clipping_recipe_works_after_a_skip_and_keeps_the_scale(tmp_path: Path) -> None:
    """Item 2: scaler.unscale_ before step(); after a NaN-loss skip the next unscale_ raised
    "unscale_() has already been called on this optimizer since the last update()"."""
    for policy in ("skip", "rollback"):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        s = nansentinel.Sentinel(model, opt, scaler=scaler, report_dir=str(tmp_path / policy),
                                 env={}, metrics_port=0, policy=policy, snapshot_every=1,
                                 inject="kind=loss,step=2", rollback_skip_batches=0)
        outcomes = []
        for step in range(5):
            scale = scaler.get_scale()
            r = _step(s, model, _batch(step), scaler, clip=True)
            outcomes.append(str(r.outcome))
            if step == 2:
                assert scaler.get_scale() == scale, "a blamed NaN is no fp16 overflow"
        want = "skipped" if policy == "skip" else "rolled_back"
        assert outcomes == ["applied", "applied", want, "applied", "applied"], outcomes
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_skipped_step_leaves_the_batchnorm_statistics_as_they_were(tmp_path: Path) -> None:
    """Item 3: the skipped step's forward had written the NaN batch into BatchNorm's running
    statistics; the model in eval() then output NaN."""
    model = _net(batchnorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={}, metrics_port=0)
    _step(s, model, _batch(0))
    norm = model[1]
    before = (norm.running_mean.clone(), norm.running_var.clone())
    r = _step(s, model, _batch(1, nan=True))
    assert not r.applied and r.buffers_restored == 2
    assert torch.equal(norm.running_mean, before[0]) and torch.equal(norm.running_var, before[1])
    assert json.loads(Path(r.report_path).read_text())["buffers_restored"] == 2
    assert _step(s, model, _batch(2)).applied and _step(s, model, _batch(2)).buffers_restored == 0
    model.eval()
    assert torch.isfinite(model(torch.randn(4, 4))).all()


def test_close_leaves_a_closed_verdict_once_and_the_launcher_tells_exit_from_mid_run(
    tmp_path: Path,
) -> None:
    """Item 4: a rank that died after its sentinel closed is told apart in the summary."""
    model = _net()
    s = nansentinel.Sentinel(model, torch.optim.SGD(model.parameters(), lr=0.1), env={},
                             report_dir=str(tmp_path), metrics_port=0, run_dir=str(tmp_path))
    _step(s, model, _batch(0))
    s.close()
    s.close()  # a second close does nothing (no second barrier)
    found = verdicts.read_verdicts(tmp_path)
    assert found[0].outcome == verdicts.CLOSED and found[0].step == 0
    at_exit = verdicts.outcome_from_verdicts(found, "vm", failed=[0])
    assert at_exit.exit_code == 1 and "after the sentinel had closed cleanly" in (
        at_exit.explanation)
    mid_run = verdicts.outcome_from_verdicts(found, "vm", failed=[0, 1])
    assert "without a sentinel verdict" in mid_run.explanation


class _Syncs(TorchDispatchMode):
    """Counts host reads of tensors (``bool(t)``, ``float(t)``, ``t.item()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if "_local_scalar_dense" in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_replay_reads_the_host_once_and_names_the_first_module() -> None:
    """Item 5: it synced once per module output and per parameter gradient."""
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)], nn.Linear(4, 1))
    batch = _batch(0, nan=True)
    with _Syncs() as syncs:
        r = replay.replay(model, batch, _loss)
    assert syncs.count == 0  # the one read is a single tolist(), not a per-hook bool()
    assert not r.finite and r.first_module == "0" and r.first_parameter is not None


def test_the_poisoned_gradients_are_freed_before_the_replay(tmp_path: Path) -> None:
    """Item 5: the replay took a second set of gradients while the poisoned ones lived."""
    seen: list[bool] = []

    def fn(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.append(all(p.grad is None for p in module.parameters()))
        return _loss(module, batch)

    model = _net()
    s = nansentinel.Sentinel(model, torch.optim.SGD(model.parameters(), lr=0.1), replay=fn,
                             report_dir=str(tmp_path), env={}, metrics_port=0)
    assert not _step(s, model, _batch(0, nan=True)).applied
    assert seen == [True]


def test_a_replay_that_fails_gives_no_verdict_and_the_run_goes_on(tmp_path: Path) -> None:
    def oom(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    model = _net()
    s = nansentinel.Sentinel(model, torch.optim.SGD(model.parameters(), lr=0.1), replay=oom,
                             report_dir=str(tmp_path), env={}, metrics_port=0)
    r = _step(s, model, _batch(0, nan=True))
    assert not r.applied and r.verdict is None
    report = json.loads(Path(r.report_path).read_text())
    assert "OutOfMemoryError" in report["poisoned"][0]["replay"]["error"]
    assert "replay_failed" in report["poisoned"][0]
    assert _step(s, model, _batch(1)).applied


class _Reads(TorchDispatchMode):
    """The largest tensor a reduction read."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        if any(op in name for op in ("sum", "norm", "abs", "pow", "mul", "_to_copy")):
            for a in args:
                if isinstance(a, torch.Tensor):
                    self.largest = max(self.largest, a.numel())
        return func(*args, **(kwargs or {}))


def test_matching_the_quarantine_reads_a_bounded_sample() -> None:
    """Item 6: once a batch had a data verdict, every batch paid three fp64 sums over all of
    its elements (a full fp64 copy), for up to 100,000 steps."""
    q = quarantine.Quarantine(torch.device("cpu"))
    big = {"x": torch.randn(1000, 1000), "ids": torch.arange(50_000)}
    q.add(quarantine.signature(big), step=0)
    norms = [torch.linalg.vector_norm(big["x"])]  # what check_batch took anyway
    with _Reads() as reads:
        assert q.match(big, step=1, norms=norms) == 1
    assert reads.largest <= quarantine.SAMPLE
    other = {"x": big["x"].clone(), "ids": big["ids"]}
    other["x"][999, 999] += 1.0  # outside the sample: the norm still tells them apart
    assert q.match(other, step=1) == 0


def test_warn_level_spike_reports_are_one_per_window(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """Item 6: on an unstable run a warn-level spike wrote a report every time."""
    registry = CollectorRegistry()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    s = nansentinel.Sentinel(model, torch.optim.SGD(model.parameters(), lr=0.0), env={},
                             report_dir=str(tmp_path), metrics_port=free_port(),
                             metrics_addr="127.0.0.1", registry=registry,
                             spike_window=20, spike_warmup=5)
    spiked = 0
    try:
        for step in range(60):
            x = torch.ones(8, 4) * (50.0 if step >= 10 and step % 4 == 0 else 1.0 + 0.01 * step)
            r = _step(s, model, {"x": x, "y": torch.zeros(8, 1)})
            spiked += bool(r.spikes)
    finally:
        s.close()
    reports = list(tmp_path.glob("incident-*.json"))
    assert spiked >= 10 and 1 <= len(reports) <= 3  # one per 20 steps of the 50 after warmup
    suppressed = registry.get_sample_value("nansentinel_spike_reports_suppressed_total")
    assert suppressed == spiked - len(reports)


def test_snapshot_copies_overlap_the_next_forward_and_order_the_next_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Items 6 of issues 20 and 35: the parameters and optimizer state are copied on a side
    stream that only their next writer waits for (the optimizer's step), so the next forward
    runs beside the copies; the buffers the forward writes (BatchNorm statistics) are copied
    on the compute stream, which orders them without a wait; a rollback waits on the host.
    On the CPU the copies are plain: what is checked is which copies go where and who waits."""
    from nansentinel.effects.recovery import SideCopies

    calls: list[object] = []

    @contextlib.contextmanager
    def record(kind: str, sources: list[torch.Tensor]) -> Iterator[None]:
        calls.append((kind, {t.data_ptr() for t in sources}))
        yield

    monkeypatch.setattr(SideCopies, "hold", lambda self, *_: calls.append("hold"))
    monkeypatch.setattr(SideCopies, "finish", lambda self: calls.append("finish"))
    monkeypatch.setattr(SideCopies, "side", lambda self, src: record("side", src))
    monkeypatch.setattr(SideCopies, "inline", lambda self, src: record("inline", src),
                        raising=False)
    model = _net(batchnorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snaps = MemorySnapshots(Watched(model, model, opt))
    snaps.save(0)
    assert calls[0] == "finish"  # the first layout: nothing to wait for, then allocated
    (inline, early), (side, late) = calls[1:]
    buffers = {b.data_ptr() for b in model.buffers()}  # BatchNorm's statistics and count
    assert (inline, side) == ("inline", "side")
    assert early == buffers and late == {p.data_ptr() for p in model.parameters()}
    calls.clear()
    model(torch.randn(4, 4)).sum().backward()
    assert calls == []  # the forward and backward wait for nothing
    opt.step()
    snaps.load()
    assert calls == ["hold", "finish"]


@pytest.mark.parametrize("bad", ["NaN", "nan", "Infinity"])
def test_signature_stats_read_back_from_json(bad: str) -> None:
    sig = quarantine.Signature.from_json({"key": "torch.float32(2,)", "stats": [1.0, bad, 0, 0]})
    assert not math.isfinite(sig.stats[1]) and sig.current
