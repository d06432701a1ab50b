"""Bus safety defaults: loopback by default, authentication for anything else."""

from __future__ import annotations

import socket

import pytest

from kf.bus import EmbeddedServer, redact, valid_run_id


def test_bus_embedded_server_listens_on_loopback_by_default() -> None:
    """With no options the embedded nats-server binds 127.0.0.1 only."""
    with EmbeddedServer() as srv:
        assert srv.host == "127.0.0.1"
        assert srv.url.startswith("nats://127.0.0.1:")


def test_bus_non_loopback_listener_requires_a_token() -> None:
    """Listening beyond loopback without authentication is refused."""
    with pytest.raises(ValueError, match="needs a token"):
        EmbeddedServer(host="0.0.0.0")


def test_bus_redacts_credentials_in_urls() -> None:
    """Tokens and passwords never reach logs or messages."""
    assert redact("nats://secret@host:4222") == "nats://***@host:4222"
    assert redact("nats://u:p@host:4222") == "nats://***@host:4222"


def test_bus_run_ids_are_safe_subject_tokens() -> None:
    """A run id with dots or spaces is refused (it becomes part of NATS subjects)."""
    assert valid_run_id("demo-1_a") == "demo-1_a"
    with pytest.raises(ValueError, match="must be 1-64 characters"):
        valid_run_id("a.b")


def test_bus_random_ports_lie_outside_the_ephemeral_range() -> None:
    """A client retrying a dead server's port inside the kernel's ephemeral range can be
    given that port as its own source and connect to itself (TCP self-connect); the
    embedded server's random port is never in that range, and is free when chosen."""
    from kf.bus import _ephemeral_range, quiet_port

    low, high = _ephemeral_range()
    ports = {quiet_port() for _ in range(200)}
    assert all(not low <= p <= high for p in ports)
    assert len(ports) > 150  # random, not one port over and over
    server = EmbeddedServer().start()
    try:
        assert not low <= server.port <= high
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
            assert conn.recv(4096).startswith(b"INFO ")
    finally:
        server.stop()
