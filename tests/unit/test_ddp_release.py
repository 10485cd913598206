"""After ``close()`` a DDP model trains on as DDP alone: on the NCCL seam (forced here, on a
one-rank gloo group, as test_ddp_hook does) a backward runs no check and launches no
exchange; on the comm-hook seam the hook DDP cannot drop averages as DDP's default does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel.engines import ddp, ddp_seam
from tests.unit.test_ddp_hook import _model, _step, group  # noqa: F401  (fixture)


@pytest.mark.parametrize("seam", [ddp_seam.END_OF_BACKWARD, ddp_seam.HOOK])
def test_after_close_a_backward_checks_nothing_and_launches_no_exchange(
    group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seam: str,  # noqa: F811
) -> None:
    monkeypatch.setattr(ddp, "seam_for", lambda *a, **k: seam)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={}, metrics_port=0)
    assert s.gradients.seam == seam
    assert _step(model, s, opt).applied
    s.close()
    launched: list[int] = []
    checked: list[int] = []
    monkeypatch.setattr(s.exchange, "launch", lambda *a, **k: launched.append(1))
    monkeypatch.setattr(s.gradients, "check_at_last", lambda: checked.append(1))
    monkeypatch.setattr(s.gradients, "bucket_norm", lambda b: checked.append(1))
    plain = DDP(_model().module)  # the same weights, DDP alone
    with torch.no_grad():
        for a, b in zip(plain.parameters(), model.parameters(), strict=True):
            a.copy_(b)
    x = torch.randn(4, 16)
    for net in (model, plain):
        net(x).pow(2).mean().backward()
    assert not launched and not checked
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and torch.allclose(a.grad, b.grad)
