"""The Python API refuses its misuses by name, with SentinelUsageError, where they happen:
the wrong objects at construction, calls out of order, use after close(), a batch that holds
itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nansentinel
from nansentinel import SentinelUsageError


def _sentinel(tmp_path: Path, **kw: object) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                     nansentinel.Sentinel]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = nansentinel.Sentinel(model, opt, env={}, metrics_port=0, report_dir=str(tmp_path), **kw)
    return model, opt, s


def _loss(model: torch.nn.Module) -> torch.Tensor:
    return model(torch.randn(2, 4)).pow(2).mean()


@pytest.mark.parametrize(("model", "optimizer", "match"), [
    ("model", None, "needs a torch.nn.Module"),
    ([], None, "an empty list"),
    ([torch.nn.Linear(2, 2), 3], None, "needs a torch.nn.Module"),
    (torch.nn.Linear(2, 2), "adam", "needs an optimizer"),
])
def test_the_wrong_objects_are_named(model: object, optimizer: object, match: str) -> None:
    with pytest.raises(SentinelUsageError, match=match):
        nansentinel.Sentinel(model, optimizer, env={}, metrics_port=0)  # type: ignore[arg-type]


def test_an_optimizer_of_another_model_is_refused() -> None:
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(SentinelUsageError, match="holds none of the model's 2 parameters"):
        nansentinel.Sentinel(torch.nn.Linear(3, 3), other, env={}, metrics_port=0)


def test_step_before_any_backward_is_refused(tmp_path: Path) -> None:
    _, _, s = _sentinel(tmp_path)
    with pytest.raises(SentinelUsageError, match=r"before any loss\.backward"):
        s.step()
    s.close()


def test_step_twice_after_one_backward_is_refused(tmp_path: Path) -> None:
    model, opt, s = _sentinel(tmp_path)
    loss = _loss(model)
    s.check_loss(loss)
    loss.backward()
    assert s.step().applied
    opt.zero_grad(set_to_none=False)  # zeroing is no backward
    with pytest.raises(SentinelUsageError, match=r"no loss\.backward"):
        s.step()
    s.close()


def test_check_loss_after_backward_is_refused_but_accumulation_is_not(tmp_path: Path) -> None:
    model, opt, s = _sentinel(tmp_path)
    for _ in range(2):  # accumulation: each loss checked before its own backward
        loss = _loss(model)
        s.check_loss(loss)
        loss.backward()
    assert s.step().applied
    opt.zero_grad()
    loss = _loss(model)
    loss.backward()
    with pytest.raises(SentinelUsageError, match=r"after loss\.backward"):
        s.check_loss(loss)
    s.close()


@pytest.mark.parametrize("call", ["check_batch", "check_loss", "check_grads", "step"])
def test_use_after_close_is_refused(tmp_path: Path, call: str) -> None:
    model, _, s = _sentinel(tmp_path)
    loss = _loss(model)
    s.check_loss(loss)
    loss.backward()
    s.step()
    s.close()
    args = {"check_batch": ({"x": torch.ones(1)},), "check_loss": (torch.tensor(1.0),)}
    with pytest.raises(SentinelUsageError, match=f"{call}\\(\\) on rank 0 after the sentinel "
                       "was closed"):
        getattr(s, call)(*args.get(call, ()))
    s.close()  # a second close still does nothing


def test_a_batch_that_holds_itself_is_named(tmp_path: Path) -> None:
    _, _, s = _sentinel(tmp_path)
    batch: list[object] = [torch.ones(2)]
    batch.append(batch)
    with pytest.raises(SentinelUsageError, match="the batch holds itself"):
        s.check_batch(batch)
    s.close()


def test_close_removes_the_backward_hooks(tmp_path: Path) -> None:
    model, _, s = _sentinel(tmp_path)
    first = next(model.parameters())
    before = len(first._post_accumulate_grad_hooks or {})
    s.close()
    assert len(first._post_accumulate_grad_hooks or {}) == before - 1
