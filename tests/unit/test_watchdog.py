"""The watchdog fires once for a stuck step, never for a disarmed or settled one."""

from __future__ import annotations

import time

from nansentinel.watchdog import Watchdog


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
    assert fired == [7] and dog.expired == 7
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
    assert fired == [] and settled.expired is None
    settled.close()


def test_a_late_step_is_reported_once_before_expiry() -> None:
    late: list[int] = []
    fired: list[int] = []
    # Expiry far after lateness, so a loaded machine's scheduling delays cannot reorder them.
    dog = Watchdog(5.0, fired.append, on_late=late.append, late_after=0.1, poll=0.02)
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
