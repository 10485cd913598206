"""Helpers shared by every test package (the fixtures over them are in conftest.py)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (servers retry on a clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
