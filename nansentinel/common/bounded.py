"""A blocking call given a time bound, for the failure paths that talk to a store.

torch's store requests block in C++ for the store's own timeout (a minute or more), where no
Python timeout reaches; across a partition they block that long again at every request, and
whatever waits on them misses every deadline it promised. :class:`OneAtATime` runs the call in
a daemon thread and waits for it at most a bound; a call still running when the next is
asked for is waited on again rather than started twice, so a store that never answers costs
one blocked thread, not one per poll. The process's exit takes the thread along. Used by
both sides: the worker's diagnosis of missing ranks and the launcher's rendezvous polls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

_T = TypeVar("_T")


class OneAtATime(Generic[_T]):
    """``fn()`` with a bound on the wait (see the module's docstring)."""

    def __init__(self, fn: Callable[[], _T], name: str = "nansentinel-bounded") -> None:
        self.fn, self.name = fn, name
        self._done = threading.Event()
        self._result: list[_T] = []
        self._error: list[BaseException] = []
        self._thread: threading.Thread | None = None

    def __call__(self, bound: float) -> tuple[bool, _T | None]:
        """``(True, fn())`` when the call returns within ``bound`` seconds (its exception is
        raised here), else ``(False, None)``: the call goes on, and the next ``__call__``
        waits for it again."""
        if self._thread is None:
            self._done.clear()
            self._result.clear()
            self._error.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        if not self._done.wait(bound):
            return False, None
        self._thread = None
        if self._error:
            raise self._error[0]
        return True, self._result[0]

    def _run(self) -> None:
        try:
            self._result.append(self.fn())
        except BaseException as exc:  # raised in the caller's thread
            self._error.append(exc)
        finally:
            self._done.set()
