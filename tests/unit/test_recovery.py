"""Snapshots restore exactly, reuse their host buffers and refuse what does not fit; the LR
cooldown composes with a scheduler."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nansentinel import SnapshotMemoryError
from nansentinel.effects.recovery import Cooldown, MemorySnapshots, SnapshotRing, UserSnapshots
from nansentinel.wire.context import Watched


def test_memory_snapshot_restores_model_and_optimizer() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    snaps = MemorySnapshots(Watched(model, model, opt))
    assert snaps.step is None
    snaps.save(7)
    saved_w = model.weight.detach().clone()
    saved_m = opt.state[model.weight]["exp_avg"].clone()
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    assert not torch.equal(model.weight, saved_w)
    assert snaps.load() == 7 and snaps.step == 7
    assert torch.equal(model.weight, saved_w)
    assert torch.equal(opt.state[model.weight]["exp_avg"], saved_m)
    opt.step()  # still a working optimizer
    assert snaps.load() == 7 and torch.equal(model.weight, saved_w)  # the snapshot is intact


def test_the_ring_replaces_a_failed_snapshot_before_the_oldest() -> None:
    """A snapshot a rollback did not help from is never restored again (History.failed): a
    new one takes its slot, and the older one the run was restored to stays kept."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ring = SnapshotRing([MemorySnapshots(Watched(model, model, opt)) for _ in range(2)])
    ring.save(10)
    ring.save(15)
    ring.save(20, stale=[15])
    assert ring.steps == [20, 10]
    ring.save(25)  # none stale: the oldest goes
    assert ring.steps == [25, 20]


def test_user_snapshots_call_the_pair() -> None:
    calls: list[object] = []
    snaps = UserSnapshots(lambda step: calls.append(("save", step)), lambda: 40)
    snaps.save(40)
    assert snaps.step == 40 and snaps.load() == 40 and calls == [("save", 40)]


def test_cooldown_scales_around_the_step_and_composes_with_a_scheduler() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    cool = Cooldown()
    cool.start(0.5, steps=2)
    seen = []
    for _ in range(3):
        saved = cool.apply(opt)
        seen.append(opt.param_groups[0]["lr"])
        cool.undo(opt, saved)
        sched.step()
    assert seen == [0.5, 0.25, 1.0 / 3]  # halved twice, then the schedule alone
    cool.start(0.5, steps=5)
    cool.start(0.5, steps=5)  # a second rollback during the cooldown compounds
    assert cool.factor == 0.25


def test_cooldown_saves_its_own_state_and_loads_older_pairs() -> None:
    c = Cooldown()
    c.start(0.5, 3)
    restored = Cooldown()
    restored.load_state_dict(c.state_dict())
    assert (restored.factor, restored.steps_left, restored.lr_factor) == (0.5, 3, 0.5)
    older = Cooldown()
    older.load_state_dict([0.25, 7])  # what checkpoints before 0.2 hold
    assert (older.factor, older.steps_left) == (0.25, 7)
    assert Cooldown().lr_factor == 1.0


def _trained(steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5),
                                torch.nn.Linear(5, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for _ in range(steps):
        _train(model, opt)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(8, 6)).pow(2).mean().backward()
    opt.step()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the live state, cloned: weights, buffers, Adam's moments and steps."""
    out = [t.detach().clone() for t in model.state_dict().values()]
    for p in model.parameters():
        out += [opt.state[p][k].detach().clone() for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_saves_reuse_the_same_host_buffers_and_a_new_layout_reallocates_them() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    snaps = MemorySnapshots(Watched(model, model, opt))
    snaps.save(0)  # before the first step: the weights alone, no optimizer state yet
    weights_only = snaps.bytes
    assert weights_only == snaps.unsharded_bytes == (12 + 3) * 4
    _train_linear(model, opt)
    snaps.save(1)  # the optimizer's state appeared: a new layout, new buffers
    assert snaps.bytes == weights_only * 3 + 2 * 4  # + exp_avg, exp_avg_sq, two steps
    pointers = [b.data_ptr() for b in snaps._buffers]
    for step in (2, 3):
        _train_linear(model, opt)
        snaps.save(step)
        assert [b.data_ptr() for b in snaps._buffers] == pointers  # no allocation per save
    assert torch.equal(snaps._buffers[0], model.weight.detach())  # the latest save's values


def _train_linear(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(5, 4)).sum().backward()
    opt.step()


def test_restore_is_exact_and_later_steps_never_write_into_the_snapshot() -> None:
    model, opt = _trained()
    snaps = MemorySnapshots(Watched(model, model, opt))
    snaps.save(2)
    saved, kept = _state(model, opt), [b.clone() for b in snaps._buffers]
    for _ in range(3):
        _train(model, opt)
    assert not _same(_state(model, opt), saved)
    assert snaps.load() == 2 and _same(_state(model, opt), saved)
    live = {t.data_ptr() for t in model.state_dict().values()}
    live |= {v.data_ptr() for s in opt.state.values() for v in s.values()}
    assert not live & {b.data_ptr() for b in snaps._buffers}  # nothing live is a buffer
    _train(model, opt)  # in-place updates after the rollback
    assert _same(snaps._buffers, kept)
    assert snaps.load() == 2 and _same(_state(model, opt), saved)


def test_restore_into_an_optimizer_whose_state_is_gone_builds_fresh_tensors() -> None:
    model, opt = _trained()
    snaps = MemorySnapshots(Watched(model, model, opt))
    snaps.save(2)
    saved, kept = _state(model, opt), [b.clone() for b in snaps._buffers]
    _train(model, opt)
    opt.state.clear()  # e.g. a reset optimizer: the live layout is no longer the snapshot's
    assert snaps.load() == 2 and _same(_state(model, opt), saved)
    _train(model, opt)
    assert _same(snaps._buffers, kept)
    assert opt.param_groups[0]["lr"] == 0.05  # hyperparameters came back too


def test_a_snapshot_that_does_not_fit_is_refused_with_the_bytes_and_nothing_is_allocated() -> None:
    model, opt = _trained()
    snaps = MemorySnapshots(Watched(model, model, opt), hostname="node7", available=lambda: 100)
    with pytest.raises(SnapshotMemoryError) as info:
        snaps.save(12)
    message = str(info.value)
    needed = sum(t.numel() * t.element_size() for t in _state(model, opt))
    assert f"needs {needed:,} bytes" in message and "100 bytes" in message
    assert "rank 0 (host node7) at step 12" in message and "rollbacks off" in message
    assert snaps.bytes == 0 and snaps.step is None
    ok = MemorySnapshots(Watched(model, model, opt), available=lambda: needed)  # just fits
    ok.save(12)
    assert ok.bytes == needed


def test_module_state_dict_versions_survive_the_snapshot() -> None:
    model, opt = _trained()
    snaps = MemorySnapshots(Watched(model, model, opt))
    snaps.save(2)
    assert snaps._skeleton is not None
    meta = snaps._skeleton["model"]._metadata
    assert meta == model.state_dict()._metadata and meta["1"]["version"] == 2  # BatchNorm's


def _gpu_slot(name: str, numel: int) -> Any:
    """A slot of state living on a GPU (pinned host buffer), built without one."""
    from nansentinel.effects.recovery import _Slot

    return _Slot(("model", name), torch.float32, (numel,), torch.device("cuda"), 0, False)


SLICE = 5_375_000  # fp32 elements: a 21.5 MB slice, which the pinned allocator rounds to 32 MiB


def test_pinned_buffers_are_counted_as_the_caching_host_allocator_rounds_them() -> None:
    from nansentinel.effects.recovery import pinned_nbytes

    assert [pinned_nbytes(n) for n in (0, 1, 4096, 4097, SLICE * 4)] == [0, 1, 4096, 8192, 2**25]
    model, opt = _trained()
    snaps = MemorySnapshots(Watched(model, model, opt), hostname="node7",
                            available=lambda: 30_000_000)
    with pytest.raises(SnapshotMemoryError, match=f"needs {2**25:,} bytes"):
        snaps._allocate((_gpu_slot("w", SLICE),), step=3)  # 21.5 MB < 30 MB, but 32 MiB pinned
    assert snaps.bytes == 0


@pytest.mark.parametrize("emptiable", [True, False])
def test_a_new_layout_counts_the_old_pinned_blocks_unless_the_host_cache_is_emptied(
    monkeypatch: pytest.MonkeyPatch, emptiable: bool,
) -> None:
    """torch's caching host allocator keeps a freed pinned block for the next request of its
    size: on a layout change the old blocks stay pinned beside the new ones unless the host
    cache is emptied between them."""
    from nansentinel.effects import recovery

    emptied: list[int] = []
    monkeypatch.setattr(recovery, "_pinned", lambda buf: True)  # as on a GPU host
    monkeypatch.setattr(recovery, "_host_cache_emptiable", lambda: emptiable)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache",
                        lambda: emptied.append(len(snaps._buffers)), raising=False)
    free = [10**9]
    model, opt = _trained()
    snaps = MemorySnapshots(Watched(model, model, opt), available=lambda: free[0])
    snaps._allocate((_gpu_slot("w", SLICE),), step=0)
    assert snaps.bytes == 2**25
    free[0] = 20_000_000  # 20 MB free beside the 32 MiB held: the new layout needs 32 MiB + 4 KiB
    grown = (_gpu_slot("w", SLICE), _gpu_slot("b", 1000))
    if emptiable:
        snaps._allocate(grown, step=1)
        assert emptied == [0]  # emptied after the old buffers were dropped, before the new ones
        assert snaps.bytes == 2**25 + 4096
    else:
        with pytest.raises(SnapshotMemoryError, match=f"needs {2**25 + 4096:,} bytes"):
            snaps._allocate(grown, step=1)
        assert snaps.bytes == 2**25 and not emptied  # the old snapshot is kept
