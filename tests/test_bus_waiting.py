"""A NATS server that stops answering (SIGSTOP): kf says once that it waits for it, not
one error line a retry, and says when it is back."""

from __future__ import annotations

import os
import signal
from typing import Any

import structlog

from kf import bus
from kf.bus import EmbeddedServer
from tests.harness import wait_for


def _said(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e.get("event") == event]


async def test_bus_stopped_server_one_waiting_line_then_back() -> None:
    """Three clients of one process on a server stopped with SIGSTOP: their retries (many)
    give one "waiting for the NATS server at <url> (no answer for N s)" line and no
    nats_error line per retry; on SIGCONT one line says the server is back."""
    with EmbeddedServer() as srv, structlog.testing.capture_logs() as logs:
        assert srv.proc is not None
        url = srv.url
        clients = [
            await bus.connect(bus.BusOptions(url=url, name=f"c{i}"), ping_interval_s=0.2)
            for i in range(3)
        ]
        waiting = bus.waiting_for(url)
        try:
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:
                await wait_for(lambda: waiting.errors >= 6, 60, "the clients to retry")
                said = _said(logs, "nats_waiting")
                assert len(said) == 1, said
                assert said[0]["note"].startswith(f"waiting for the NATS server at {url} ")
                assert "no answer for" in said[0]["note"], said[0]
                assert _said(logs, "nats_error") == [], _said(logs, "nats_error")
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            await wait_for(lambda: _said(logs, "nats_back"), 60, "the server to be back")
            for nc in clients:
                await nc.flush(timeout=30)  # each client answers again
            back = _said(logs, "nats_back")
            assert len(back) == 1 and url in back[0]["note"], back
            assert len(_said(logs, "nats_waiting")) == 1
        finally:
            for nc in clients:
                await bus.close(nc)
