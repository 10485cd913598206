"""The sentinel's deadline inside the process group's own timeout, on two gloo ranks
(issue 20, item 8): the harness's group times out after 60 s, shorter than exchange_timeout
(here 250 s) with the naming after it, so the sentinel waits less, says so once on rank 0 (a
warning: the value was the user's), and follows the group's timeout when the loop changes it
(as torchtitan does), read again when the next step's first collective leaves."""

from __future__ import annotations

import datetime
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.distributed.harness import run_ranks, values


def fitted(rank: int, world: int) -> dict[str, Any]:
    import nansentinel

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    logging.getLogger("nansentinel").addHandler(Keep())
    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A value the user chose (not the default): its shortening is a warning.
    sentinel = nansentinel.Sentinel(model, opt, env={}, metrics_port=0, exchange_timeout=250)
    first = (sentinel.exchange.timeout, sentinel.watchdog.timeout)
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=40))
    time.sleep(1.0)  # the watchdog's thread looks meanwhile, and must not read the group
    unchanged = sentinel.exchange.timeout
    # The next step's first collective reads the group's timeout again, on the loop's thread.
    x = torch.randn(8, 4)
    sentinel.check_batch(x)
    loss = model(x).square().mean()
    sentinel.check_loss(loss)
    loss.backward()
    sentinel.step()
    out = {"first": first, "unchanged": unchanged, "later": sentinel.exchange.timeout,
           "dog": sentinel.watchdog.timeout, "warnings": records}
    sentinel.close()
    return out


@pytest.mark.timeout(120)
def test_a_shorter_group_timeout_shortens_the_deadline_on_every_rank(tmp_path: Path) -> None:
    from nansentinel.wire.watchdog import watchdog_deadline

    # Without DETAIL: its wrapper of the group takes no new timeout (torch 2.13:
    # "Set timeout is now only supported for either nccl or gloo").
    results = values(run_ranks(fitted, 2, tmp_path, timeout=90,
                               env={"TORCH_DISTRIBUTED_DEBUG": "OFF"}))
    for r in results:
        assert r["first"] == (37.0, watchdog_deadline(37.0))  # 37 + 2 * 10 + 2 = 60 - 1
        assert r["unchanged"] == 37.0  # until a step arms the deadline
        assert r["later"] == 18.5  # 18.5 + 2 * 9.25 + 2 = 40 - 1
        assert r["dog"] == watchdog_deadline(18.5)
    assert len(results[0]["warnings"]) == 2 and not results[1]["warnings"]
    assert "group's timeout (60 s)" in results[0]["warnings"][0]
    assert "group's timeout (40 s)" in results[0]["warnings"][1]
