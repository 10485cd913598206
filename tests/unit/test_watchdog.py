"""The watchdog fires once for a stuck step, never for a disarmed or settled one."""

from __future__ import annotations

import time

from nansentinel.wire.watchdog import Watchdog


def wait_for(predicate, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_fires_once_for_a_stuck_step() -> None:
    fired: list[int] = []
    dog = Watchdog(0.2, fired.append, poll=0.02)
    dog.arm(7)
    dog.arm(8)  # already armed: the first deadline stands
    assert wait_for(lambda: fired == [7])
    time.sleep(0.2)
    assert fired == [7]
    dog.close()


def test_disarmed_and_settled_steps_do_not_fire() -> None:
    fired: list[int] = []
    dog = Watchdog(0.2, fired.append, poll=0.02)
    dog.arm(1)
    dog.disarm()
    time.sleep(0.4)
    assert fired == []
    dog.close()
    settled = Watchdog(0.1, fired.append, poll=0.02, settled=lambda: True)
    settled.arm(2)
    time.sleep(0.3)
    assert fired == []
    settled.close()


def test_a_late_step_is_reported_once_before_expiry() -> None:
    late: list[int] = []
    fired: list[int] = []
    # Expiry far after lateness, so a loaded machine's scheduling delays cannot reorder them.
    dog = Watchdog(5.0, fired.append, late=(0.1, late.append), poll=0.02)
    dog.arm(3)
    assert wait_for(lambda: late == [3], timeout=3.0)
    assert fired == []  # late is not expired
    time.sleep(0.2)
    assert late == [3]  # once per step
    dog.disarm()
    dog.arm(4)
    assert wait_for(lambda: late == [3, 4], timeout=3.0)
    dog.disarm()
    dog.arm(5)
    dog.disarm()  # a step that finishes in time is never reported
    time.sleep(0.3)
    assert late == [3, 4] and fired == []
    dog.close()


def test_a_slow_step_whose_collectives_finished_is_not_late() -> None:
    """A pause after backward, before ``step()``: the collectives completed, so the rank is
    not blocked in one and its watchdog never checks it in (no store request)."""
    late: list[int] = []
    dog = Watchdog(5.0, lambda step: None, late=(0.05, late.append), poll=0.01,
                   settled=lambda: True)
    dog.arm(1)
    time.sleep(0.3)
    assert late == []
    dog.close()


def test_armed_for_counts_from_the_arming_of_that_step_only() -> None:
    now = [100.0]
    dog = Watchdog(5.0, lambda step: None, clock=lambda: now[0], poll=10.0)
    assert dog.armed_for(3) is None
    dog.arm(3)
    now[0] = 102.5
    assert dog.armed_for(3) == 2.5 and dog.armed_for(4) is None
    dog.restart(3)  # a collective launched now: counted from here
    assert dog.armed_for(3) == 0.0
    dog.disarm()
    assert dog.armed_for(3) is None
    dog.close()


def test_the_late_check_in_is_at_the_timeout_and_the_naming_fits_after_it() -> None:
    from nansentinel.wire.exchange import diagnosis_grace, late_after
    from nansentinel.wire.watchdog import naming_seconds, watchdog_deadline

    for timeout in (4.0, 27.0, 300.0):
        assert late_after(timeout) == timeout  # a slow healthy step never checks in
        # The first diagnosing rank's look (arming + timeout + grace) is due by the deadline.
        assert late_after(timeout) + diagnosis_grace(timeout) <= watchdog_deadline(timeout)
        assert naming_seconds(timeout) == watchdog_deadline(timeout) + diagnosis_grace(timeout)


def test_each_launched_collective_restarts_the_deadline() -> None:
    """Gradient accumulation under FSDP2: a reduce-scatter per micro-batch, the user's own work
    between them. The deadline counts from the last collective launched, not the first."""
    now = [0.0]
    fired: list[int] = []
    dog = Watchdog(8.0, fired.append, clock=lambda: now[0], poll=0.01)
    dog.arm(0)
    for t in (3.0, 6.0, 9.0):  # three micro-batches, 3 s apart: 9 s > 8 s in all
        now[0] = t
        dog.restart(0)
        time.sleep(0.05)
    assert fired == []
    now[0] = 16.9
    time.sleep(0.1)
    assert fired == []  # 7.9 s after the last launch
    now[0] = 17.1
    assert wait_for(lambda: fired == [0])
    dog.close()


# -- the deadline inside the process group's own timeout (issue 20, item 8) -------------------


def test_fitted_timeout_ends_the_naming_before_the_groups_timeout() -> None:
    from nansentinel.wire.watchdog import fitted_timeout, naming_seconds

    assert fitted_timeout(300.0, None) == 300.0  # the group's is unknown
    assert fitted_timeout(300.0, 1800.0) == 300.0  # gloo's default: it fits
    fitted = fitted_timeout(300.0, 100.0)  # torchtitan after step 1
    assert fitted is not None and 60.0 < fitted < 100.0
    assert fitted == 77.0 and naming_seconds(fitted) == 99.0  # a second left to exit in
    assert fitted_timeout(10.0, 12.0) is None  # no timeout leaves room to name anyone


def test_the_group_timeout_is_read_at_arming_never_from_the_watchdog_thread(
    free_port, monkeypatch  # type: ignore[no-untyped-def]
) -> None:
    """``ProcessGroup.getBackend`` inserts into an unlocked map on a device type's first look:
    from the watchdog's thread, racing a collective on the same group (the likeliest cause of
    a torchtitan rank's SIGSEGV in CI). The group's backends are found once, at construction,
    and their timeout is read when a step is armed, on the arming thread; the watchdog's
    thread, polling meanwhile, reads neither."""
    import datetime
    import threading
    from types import SimpleNamespace

    import torch.distributed as dist

    from nansentinel.wire import watchdog as wd

    readers: list[str] = []
    for name in ("group_backends", "backends_timeout"):
        real = getattr(wd, name)

        def spy(*args, _real=real, _name=name):  # type: ignore[no-untyped-def]
            readers.append(f"{_name}@{threading.current_thread().name}")
            return _real(*args)

        monkeypatch.setattr(wd, name, spy)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    exchange = SimpleNamespace(group=None, timeout=300.0, world_size=2, settled=lambda: False,
                               check_in=lambda step: None)
    deadline = wd.StepDeadline(exchange, 300.0, on_expire=lambda step: None, speak=False)
    try:
        assert deadline.dog is not None
        assert exchange.timeout == 37.0  # clamped at construction
        main = threading.current_thread().name
        assert readers == [f"group_backends@{main}", f"backends_timeout@{main}"]
        time.sleep(4 * deadline.dog.poll + 0.1)  # the watchdog looks several times
        assert len(readers) == 2
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=30))
        deadline.arm()  # the step's first collective: the new timeout is read now
        assert wd.naming_seconds(exchange.timeout) < 30.0
        assert deadline.dog.timeout == wd.watchdog_deadline(exchange.timeout)
        deadline.arm()  # already armed: nothing read again
        deadline.disarm()
        assert readers[2:] == [f"backends_timeout@{main}"]
    finally:
        deadline.close()
        dist.destroy_process_group()


def test_a_short_gloo_group_timeout_clamps_the_deadline_and_is_rechecked(
    free_port, caplog  # type: ignore[no-untyped-def]
) -> None:
    import datetime
    import logging
    from types import SimpleNamespace

    import torch.distributed as dist

    from nansentinel.wire.exchange import late_after
    from nansentinel.wire.watchdog import (
        TimeoutFit,
        group_timeout,
        naming_seconds,
        watchdog_deadline,
    )

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    dog = Watchdog(watchdog_deadline(300.0), lambda step: None,
                   late=(late_after(300.0), lambda step: None))
    try:
        assert group_timeout(None) == 60.0
        exchange = SimpleNamespace(group=None, timeout=300.0)
        with caplog.at_level(logging.INFO, logger="nansentinel"):
            fit = TimeoutFit(exchange, 300.0, dog, speak=True)
        clamped = exchange.timeout
        assert clamped == 37.0 and naming_seconds(clamped) == 59.0
        assert dog.timeout == watchdog_deadline(clamped)
        assert dog.late_after == late_after(clamped)
        # The default shortened is said (INFO); a value the user chose is warned about.
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        (warning,) = [r.getMessage() for r in caplog.records]
        assert "group's timeout (60 s)" in warning and "exchange_timeout=300 s" in warning
        assert "NANSENTINEL_EXCHANGE_TIMEOUT" in warning
        assert "waits 37 s" in warning and "at most 37 s" in warning
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="nansentinel"):
            chosen = SimpleNamespace(group=None, timeout=200.0)
            TimeoutFit(chosen, 200.0, Watchdog(1.0, lambda step: None), speak=True).watchdog.close()
        assert chosen.timeout == 37.0 and [r.levelno for r in caplog.records] == [logging.WARNING]
        assert "exchange_timeout=200 s" in caplog.records[0].getMessage()
        caplog.clear()
        fit.check()  # unchanged: nothing said again
        assert not caplog.records
        # torchtitan shortens the group's timeout after the first step ...
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=30))
        fit.check()
        assert naming_seconds(exchange.timeout) < 30.0 < naming_seconds(clamped)
        # ... a group timeout nobody can be named within keeps the configured value ...
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=12))
        with caplog.at_level(logging.WARNING, logger="nansentinel"):
            fit.check()
        assert exchange.timeout == 300.0 and "too short" in caplog.records[-1].getMessage()
        # ... and a long one gives the configured value back, silently (rank 0 only speaks).
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=3600))
        quiet = TimeoutFit(SimpleNamespace(group=None, timeout=300.0), 300.0, dog, speak=False)
        fit.check()
        assert exchange.timeout == 300.0 and dog.timeout == watchdog_deadline(300.0)
        assert quiet.exchange.timeout == 300.0
    finally:
        dog.close()
        dist.destroy_process_group()
