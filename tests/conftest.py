"""Shared fixtures: a real nats-server on a random loopback port, temporary logs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kf.bus import EmbeddedServer
from kf.logs import configure

configure("WARNING", json=True)


@pytest.fixture
def nats_server() -> Iterator[EmbeddedServer]:
    """A real nats-server listening on a random loopback port, stopped afterwards."""
    server = EmbeddedServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """Where a test's event log lives."""
    return tmp_path / "run.db"
