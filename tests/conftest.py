"""Fixtures shared by the test packages."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import support


def pytest_configure(config: pytest.Config) -> None:
    """TESTS_AGAINST_INSTALL=1 (tests/run_floor_lane.sh): the tests run against the
    installed wheel, so a nansentinel imported from the checkout is refused at once."""
    if os.environ.get("TESTS_AGAINST_INSTALL") == "1":
        import nansentinel

        where = Path(nansentinel.__file__).resolve()
        if where.is_relative_to(Path(__file__).resolve().parents[1]):
            raise pytest.UsageError(f"TESTS_AGAINST_INSTALL=1, but nansentinel was "
                                    f"imported from the checkout ({where}), not the install")


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Call it for a TCP port free on 127.0.0.1 a moment ago, as many times as needed."""
    return support.free_port
