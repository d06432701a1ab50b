"""Bus safety defaults: loopback by default, authentication for anything else."""

from __future__ import annotations

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
