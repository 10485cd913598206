"""Fixtures shared by the test packages."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests import support


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Call it for a TCP port free on 127.0.0.1 a moment ago, as many times as needed."""
    return support.free_port
