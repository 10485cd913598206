"""The floating buffers a skipped step puts back: exactly, and on the device gate in a fixed
number of operations whatever the number of buffers."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nansentinel.checks.buffers import FloatingBuffers


class _Ops(TorchDispatchMode):
    """Counts the operators called (each once, however many tensors a foreach one takes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class _Halves(nn.Module):
    """A module with a bf16 buffer beside the fp32 ones (a second dtype to restore)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.arange(6, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.5)
        return x


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.BatchNorm1d(4) for _ in range(layers)], _Halves())


def _buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in model.buffers() if b.is_floating_point()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit for bit (a NaN equals the same NaN)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return all(torch.equal(x.view(ints[x.element_size()]), y.view(ints[y.element_size()]))
               for x, y in zip(a, b, strict=True))


def test_a_device_gated_restore_is_a_fixed_number_of_passes_and_exact() -> None:
    """Issue 35 item 9: every step of the device gate runs ``restore_where``, healthy or not;
    it was a ``where`` and a ``copy_`` per floating buffer (212 launches for ResNet-50). Now a
    gather, one ``where`` and a scatter per dtype and device: the same count at 8 buffers as
    at 80."""
    counts = []
    for layers in (4, 40):
        model = _model(layers)
        buffers = FloatingBuffers(model)
        assert len(buffers) == 2 * layers + 1
        before = _buffers(model)
        model(torch.randn(8, 4))  # the step's forward: copied first, then updated
        first = model[0].running_mean  # type: ignore[index]
        first[1] = float("nan")  # what a poisoned batch leaves in BatchNorm's statistics
        after = _buffers(model)
        assert not _same(before, after)
        with _Ops() as seen:
            buffers.restore_where(torch.tensor(0.0))  # applied: kept as they are
        assert _same(_buffers(model), after)  # the NaN too: a kept buffer is copied exactly
        buffers.restore_where(torch.tensor(1.0))  # skipped: put back
        assert _same(_buffers(model), before)
        counts.append(sum(seen.ops.values()))
        assert seen.ops["where"] == 2, seen.ops  # one per dtype: fp32 and bf16
    assert counts[0] == counts[1] <= 8, counts


def test_the_host_restore_and_a_reassigned_buffer_still_work() -> None:
    model = _model(3)
    buffers = FloatingBuffers(model)
    before = _buffers(model)
    model(torch.randn(8, 4))
    assert buffers.copied == len(buffers) and buffers.restore() == len(buffers)
    assert _same(_buffers(model), before)
    buffers.reset()
    model[3].ema = torch.ones(6, dtype=torch.float64)  # type: ignore[index]  # reassigned
    kept = _buffers(model)
    model(torch.randn(8, 4))  # copied again, in the buffer's new dtype, then updated
    assert not _same(_buffers(model), kept)
    buffers.restore_where(torch.tensor(1.0))
    assert _same(_buffers(model), kept)
