"""Healthy DDP steps are plain DDP's bit for bit: the hook averages with DDP's own arithmetic.

Three gloo ranks (a world that is not a power of two, where 1/world is inexact), fp32, bf16
and fp16 buckets, with and without ``gradient_as_bucket_view`` (whose kept gradients DDP
divides by the world instead of multiplying by 1/world). NCCL's rule is the same hook, checked
by its arithmetic in ``tests/unit/test_gradpaths.py`` (no GPU here).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_averaging import CASES, ddp_against_plain


@pytest.mark.timeout(240)
def test_healthy_ddp_steps_equal_plain_ddp_bit_for_bit(tmp_path: Path) -> None:
    for rank_cases in values(run_ranks(ddp_against_plain, 3, tmp_path, timeout=200,
                                       report_dir=str(tmp_path))):
        assert [tuple(c[:3]) for c in rank_cases] == CASES
        differ = [c for c in rank_cases if not all(c[3])]
        assert not differ, f"(dtype, as_view, set_to_none, [each step, weights]): {differ}"
