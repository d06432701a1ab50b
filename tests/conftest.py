"""Shared fixtures: a real nats-server on a random loopback port, temporary logs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kf.bus import EmbeddedServer
from kf.logs import configure

configure("WARNING", json=True)

# Profiles time the reference under torch.compile too, which costs seconds of compiling on
# CI's 2 cores per fresh reference runner: off for the suite, on in the tests of it
# (tests/test_compile_baseline.py), which set $KF_COMPILE_BASELINE themselves.
os.environ.setdefault("KF_COMPILE_BASELINE", "0")


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
