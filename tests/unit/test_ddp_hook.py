"""The DDP path's work per bucket (issue 46): the check rides on the last bucket, one fused
pass over the still-local ``.grad`` tensors, not one norm per bucket; gradients that are the
buckets' own views, and a drill written into a bucket, keep the check per bucket. On NCCL the
path registers no comm hook at all (ddp_seam.py): the same check runs in one callback at the
end of backward, forced here on gloo."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel import checks
from nansentinel.engines import ddp, ddp_seam


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(as_view: bool = False) -> DDP:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
    # About a layer a bucket: many buckets, as a large model has at 25 MB.
    return DDP(net, bucket_cap_mb=0.001, gradient_as_bucket_view=as_view)


def _step(model: DDP, s: nansentinel.Sentinel, opt: torch.optim.Optimizer,
          count: dict[str, int] | None = None) -> Any:
    x = torch.randn(4, 16)
    s.check_batch({"x": x})
    loss = model(x).pow(2).mean()
    s.check_loss(loss)
    if count is not None:
        count.clear()
    loss.backward()
    if count is not None:
        count["done"] = 1  # calls after backward are not the hook's
    r = s.step()
    opt.zero_grad(set_to_none=True)
    return r


def _counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the two ways a gradient check is taken, during backward (the hook's)."""
    count: dict[str, int] = {}
    for name in ("tensor_norm", "grad_norms"):
        original = getattr(checks, name)

        def wrapped(*a: Any, _name: str = name, _f: Any = original, **k: Any) -> Any:
            if "done" not in count:
                count[_name] = count.get(_name, 0) + 1
            return _f(*a, **k)

        monkeypatch.setattr(checks, name, wrapped)
    hook = ddp._comm_hook

    def counted_hook(state, bucket):
        count["buckets"] = count.get("buckets", 0) + 1
        return hook(state, bucket)

    monkeypatch.setattr(ddp, "_comm_hook", counted_hook)
    return count


@pytest.mark.parametrize("as_view", [False, True])
def test_the_check_rides_on_the_last_bucket_unless_the_gradients_are_bucket_views(
    group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_view: bool,
) -> None:
    count = _counted(monkeypatch)
    model = _model(as_view)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    s = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={}, metrics_port=0)
    for _ in range(3):  # DDP rebuilds its buckets after the first step
        r = _step(model, s, opt, count)
        assert r.applied and math.isfinite(r.local_grad_norm)
    assert count["buckets"] >= 8
    if as_view:  # the all-reduce overwrites them in place: each bucket checked before it
        assert count.get("tensor_norm") == count["buckets"] and "grad_norms" not in count
    else:  # one fused pass over every gradient (one device and dtype here)
        assert count.get("grad_norms") == 1 and "tensor_norm" not in count
    s.close()


@pytest.mark.parametrize("gate", ["host", "device"])
def test_a_backward_only_nan_is_caught_at_the_last_bucket_and_named(
    group: None, tmp_path: Path, gate: str,
) -> None:
    """The forward and loss finite, one gradient NaN in backward (before DDP copies it into
    its bucket): flagged and named from the local ``.grad`` at the last bucket, the step
    skipped; the same on the device gate, which names from the kept norms."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    s = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={}, metrics_port=0,
                             gate=gate)
    _step(model, s, opt)
    weights = [p.detach().clone() for p in model.parameters()]
    handle = model.module[3].weight.register_hook(lambda g: g * math.nan)
    r = _step(model, s, opt)
    handle.remove()
    s.check_batch({"x": torch.ones(1, 16)})  # decides a deferred step
    assert not r.applied and r.kinds == ["grad"] and r.bad_ranks == [0]
    assert r.parameters == {0: ["3.weight"]}
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    s.close()


def test_a_grad_drill_in_the_first_bucket_is_checked_there(
    group: None, tmp_path: Path,
) -> None:
    """The drill writes into the first bucket (which ``.grad`` does not see): that step is
    checked bucket by bucket, so the drill is caught and its parameter named."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    s = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={}, metrics_port=0,
                             inject="kind=grad,rank=0,step=2")
    results = [_step(model, s, opt) for _ in range(4)]
    assert [r.applied for r in results] == [True, True, False, True]
    assert results[2].kinds == ["grad"] and list(results[2].parameters) == [0]
    s.close()


@pytest.fixture
def end_of_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam NCCL takes, on gloo: no comm hook, one callback at the end of backward."""
    monkeypatch.setattr(ddp, "seam_for", lambda *a, **k: ddp_seam.END_OF_BACKWARD)


def test_the_nccl_seam_registers_no_comm_hook_and_checks_once_in_backward(
    group: None, end_of_backward: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    count = _counted(monkeypatch)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    plain = _model()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.1, fused=True)
    s = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={}, metrics_port=0)
    assert s.gradients.seam == ddp_seam.END_OF_BACKWARD
    torch.manual_seed(1)
    for _ in range(3):
        r = _step(model, s, opt, count)
        assert r.applied and math.isfinite(r.local_grad_norm)
        assert "buckets" not in count and count.get("grad_norms") == 1, count
        assert not s.exchange.launched  # launched in backward, decided in step()
    torch.manual_seed(1)  # plain DDP on the same batches: the same weights, bit for bit
    for _ in range(3):
        x = torch.randn(4, 16)
        plain(x).pow(2).mean().backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(),
                                                  strict=True))
    s.close()


def test_the_nccl_seam_under_no_sync_checks_the_accumulated_gradients_once(
    group: None, end_of_backward: None, tmp_path: Path,
) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    s = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={}, metrics_port=0)
    calls: list[int] = []
    check = s.gradients.check_at_last
    s.gradients.check_at_last = lambda: (calls.append(1), check())[1]  # type: ignore[method-assign]
    x = torch.randn(4, 16)
    with model.no_sync():
        s.check_batch({"x": x})
        loss = model(x).pow(2).mean()
        s.check_loss(loss)
        loss.backward()
    assert not calls and not s.exchange.launched  # nothing reduced, nothing checked
    handle = model.module[5].bias.register_hook(lambda g: g * math.nan)
    loss = model(x).pow(2).mean()
    loss.backward()
    handle.remove()
    r = s.step()
    assert calls == [1] and not r.applied and r.parameters == {0: ["5.bias"]}
    s.close()


@pytest.mark.parametrize("gate", ["host", "device"])
def test_the_nccl_seam_catches_and_names_a_backward_only_nan(
    group: None, end_of_backward: None, tmp_path: Path, gate: str,
) -> None:
    test_a_backward_only_nan_is_caught_at_the_last_bucket_and_named(group, tmp_path, gate)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor


class Wrapped(torch.nn.Module):
    """Returns its output in a dataclass, or in an object no walk looks into."""

    def __init__(self, opaque: bool) -> None:
        super().__init__()
        self.net, self.opaque = torch.nn.Linear(16, 16), opaque

    def forward(self, x: torch.Tensor) -> Any:
        y = self.net(x)
        return SimpleNamespace(logits=y) if self.opaque else Out(y)


@pytest.mark.parametrize("opaque", [False, True])
def test_the_nccl_seam_finds_outputs_in_dataclasses_and_says_when_it_finds_none(
    group: None, end_of_backward: None, tmp_path: Path, opaque: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = DDP(Wrapped(opaque))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    s = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={}, metrics_port=0)
    with caplog.at_level(logging.WARNING, logger="nansentinel"):
        for _ in range(2):
            x = torch.randn(4, 16)
            s.check_batch({"x": x})
            loss = model(x).logits.pow(2).mean()
            s.check_loss(loss)
            loss.backward()
            assert s.exchange.launched is not opaque  # checked in backward, or not at all
            assert s.step().applied
    said = [r.message for r in caplog.records if "checked after DDP reduced" in r.message]
    assert len(said) == (1 if opaque else 0)
    s.close()


def test_sparse_gradients_are_ddps_own_rule_and_keep_the_comm_hook() -> None:
    """DDP reduces as sparse the gradients of ``nn.Embedding``/``nn.EmbeddingBag(sparse=True)``
    parameters, judged by the first module holding one (a head tied to the embedding counts
    as the embedding's); and since its own all-reduce writes a sparse sum into ``.grad`` in
    place, a model that holds one keeps the comm hook on NCCL too."""
    emb = torch.nn.Embedding(5, 3, sparse=True)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight  # tied
    frozen = torch.nn.EmbeddingBag(5, 3, sparse=True).requires_grad_(False)
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "frozen": frozen,
                                 "dense": torch.nn.Embedding(5, 3)})
    assert ddp_seam.sparse_parameters(model) == {id(emb.weight)}
    tied_first = torch.nn.ModuleDict({"head": head, "emb": emb})
    assert ddp_seam.sparse_parameters(tied_first) == set()  # DDP expects it dense then
    assert ddp_seam.seam_for("nccl", as_view=False, per_reduction=False) == ddp_seam.END_OF_BACKWARD
    assert ddp_seam.seam_for("nccl", as_view=False, per_reduction=False,
                             sparse=True) == ddp_seam.HOOK


def test_a_sparse_buckets_norm_is_kept_under_its_parameters_name() -> None:
    """DDP's bucket for a sparse gradient lists no ``gradients()``: its buffer is the
    gradient, and the device gate's kept norms name it by the bucket's one parameter."""
    from nansentinel.engines.local import BucketNorms

    wrapper = SimpleNamespace(module=torch.nn.ModuleDict({"emb": torch.nn.Embedding(4, 2)}))
    norms = BucketNorms(wrapper)  # type: ignore[arg-type]
    grad = torch.sparse_coo_tensor([[1, 1], [0, 1]], [3.0, math.nan], (4, 2))
    bucket = SimpleNamespace(buffer=lambda: grad, gradients=lambda: [],
                             parameters=lambda: [wrapper.module["emb"].weight])
    assert math.isnan(norms.norm(bucket, keep=False))
    assert math.isnan(norms.norm(bucket, keep=True))
    kept = norms.take()
    assert kept is not None and kept.poisoned() == ["emb.weight"]
