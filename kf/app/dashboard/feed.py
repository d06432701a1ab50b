"""A run's log as the dashboard reads it: opened read-only (:func:`open_log`, a clear
error for anything else), folded into a :class:`~kf.app.dashboard.view.RunView` and followed
as it grows (:class:`Feed`), with the hash chain's status (:func:`integrity_state`). The
live app (:mod:`kf.app.dashboard.app`) and the static report (:mod:`kf.app.dashboard.page`) both
read a run through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

import structlog

from kf.app.dashboard.view import RunView
from kf.events import EventError, Record
from kf.log import EventLog, Integrity, LogError, LogTooNew

__all__ = ["DashboardError", "Feed", "integrity_state", "open_log"]

_BATCH = 2000
_log = structlog.get_logger("kf.app.dashboard")


class DashboardError(RuntimeError):
    """The dashboard cannot show this file; the message says why and what to pass instead."""


def open_log(db: str | Path) -> EventLog:
    """Open a run's log read-only, or raise :class:`DashboardError` saying what is wrong."""
    path = Path(db)
    if not path.exists():
        raise DashboardError(
            f"{path}: no such file; pass a run's event log (kf run writes runs/<run_id>.db)"
        )
    if path.is_dir():
        raise DashboardError(f"{path}: is a folder; pass a run's event log file (runs/<id>.db)")
    try:
        return EventLog(path, readonly=True)
    except LogTooNew as exc:  # it says what to do: upgrade kf
        raise DashboardError(str(exc)) from None
    except LogError as exc:
        raise DashboardError(f"{exc}; pass a log written by kf run") from None
    except sqlite3.DatabaseError as exc:
        raise DashboardError(f"{path}: not a kf event log ({exc})") from None


class Feed:
    """Follows the committed log into a :class:`RunView` and tells subscribers it moved."""

    def __init__(self, elog: EventLog, *, poll_s: float = 0.25) -> None:
        self.elog = elog
        self.view = RunView()
        self.poll_s = poll_s
        self.undecodable = 0
        self.integrity: Integrity = elog.verify()
        self._subscribers: set[asyncio.Queue[int | None]] = set()
        self._closed = False

    def catch_up(self, limit: int | None = None) -> int:
        """Fold committed events after the view's head (at most ``limit``); return how many."""
        start = self.view.head + 1
        stop = None if limit is None else start + limit - 1
        n = 0
        for body in self.elog.read_raw(start, stop):
            n += 1
            try:
                rec = Record.from_bytes(body)
            except EventError as exc:
                self.undecodable += 1
                self.view.head += 1
                _log.warning("dashboard.undecodable_event", seq=self.view.head, error=str(exc))
                continue
            self.view.feed(rec)
        if n:
            self.integrity = self.elog.verify()
        return n

    async def follow(self) -> None:
        """Poll the log for new events forever, notifying subscribers after each batch."""
        while True:
            n = self.catch_up(_BATCH)
            if n:
                self._publish(self.view.head)
            if n < _BATCH:
                await asyncio.sleep(self.poll_s)
            else:
                await asyncio.sleep(0)

    def subscribe(self) -> asyncio.Queue[int | None]:
        """A queue receiving the new head after each change (``None``: the app is closing)."""
        q: asyncio.Queue[int | None] = asyncio.Queue(maxsize=64)
        if self._closed:
            q.put_nowait(None)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[int | None]) -> None:
        """Stop sending to ``q``."""
        self._subscribers.discard(q)

    def _publish(self, head: int | None) -> None:
        for q in self._subscribers:
            if q.full():
                # the page refetches the whole state on any message: the latest is enough
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
            q.put_nowait(head)

    def close(self) -> None:
        """Tell every stream to end (on app shutdown)."""
        self._closed = True
        self._publish(None)


def integrity_state(found: Integrity) -> dict[str, object]:
    """The chain's status as the page shows it."""
    return {**found.as_json(), "message": found.message()}
