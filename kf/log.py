"""The event log: one append-only SQLite file per run, the source of truth.

Written through sqlite-utils. WAL with ``synchronous=FULL``; triggers make the database
itself refuse UPDATE and DELETE on events; ``seq`` is gapless (one writer, assigned in
the appending transaction); ``event_id`` is unique, so appending an event twice leaves
one row. Messages that could not be decoded go to a separate ``rejected`` table, so bad
input is kept for inspection and never enters the log.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import msgspec
import sqlite_utils

from kf.events import Envelope, Record, decode_envelope, encode_envelope

__all__ = ["EventLog", "LogError"]

_SCHEMA_VERSION = 1


class LogError(RuntimeError):
    """The log file is missing, not a kf log, or refused a write."""


class EventLog:
    """An append-only event log in one SQLite file. Not thread-safe: one writer task owns it."""

    def __init__(self, path: str | Path, *, create: bool = True, readonly: bool = False) -> None:
        self.path = Path(path)
        if not self.path.exists() and (readonly or not create):
            raise LogError(f"{self.path}: no such event log")
        if readonly:
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path)
        conn.isolation_level = None  # explicit transactions
        self.db = sqlite_utils.Database(conn)
        self._conn = conn
        if not readonly:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            self._ensure_schema()
        elif "events" not in self.db.table_names():
            raise LogError(f"{self.path}: not a kf event log (no events table)")
        row = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()
        self._head: int = row[0]

    def _ensure_schema(self) -> None:
        db = self.db
        if "events" not in db.table_names():
            db.table("events").create(
                {
                    "seq": int,
                    "event_id": str,
                    "type": str,
                    "source": str,
                    "caused_by": str,
                    "based_on": int,
                    "schema": int,
                    "time": float,
                    "body": bytes,
                },
                pk="seq",
                not_null={"event_id", "type", "source", "schema", "time", "body"},
            )
            db.table("events").create_index(["event_id"], unique=True)
            db.table("events").create_index(["type", "seq"])
            db.table("events").create_index(["caused_by"])
            db.execute(
                "CREATE TRIGGER events_no_update BEFORE UPDATE ON events "
                "BEGIN SELECT RAISE(ABORT, 'kf event log is append-only: UPDATE refused'); END"
            )
            db.execute(
                "CREATE TRIGGER events_no_delete BEFORE DELETE ON events "
                "BEGIN SELECT RAISE(ABORT, 'kf event log is append-only: DELETE refused'); END"
            )
            db.table("rejected").create(
                {"id": int, "received": float, "subject": str, "reason": str, "body": bytes},
                pk="id",
            )
            db.table("meta").create({"key": str, "value": str}, pk="key")
            db.table("meta").insert({"key": "format", "value": f"kf-log/{_SCHEMA_VERSION}"})

    # -- writing -----------------------------------------------------------------------

    @property
    def head(self) -> int:
        """The highest committed ``seq`` (0 for an empty log)."""
        return self._head

    def append(self, envelopes: Sequence[Envelope]) -> list[Envelope]:
        """Commit new envelopes in one transaction; return them with ``seq`` assigned.

        Envelopes whose ``event_id`` is already in the log (or repeated in the batch) are
        skipped: the result holds only what this call committed.
        """
        if not envelopes:
            return []
        ids = [e.event_id for e in envelopes]
        existing: set[str] = set()
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            existing.update(
                r[0]
                for r in self._conn.execute(
                    f"SELECT event_id FROM events WHERE event_id IN ({marks})", chunk
                )
            )
        committed: list[Envelope] = []
        seq = self._head
        for env in envelopes:
            if env.event_id in existing:
                continue
            existing.add(env.event_id)
            seq += 1
            committed.append(msgspec.structs.replace(env, seq=seq))
        if not committed:
            return []
        rows = [
            {
                "seq": e.seq,
                "event_id": e.event_id,
                "type": e.type,
                "source": e.source,
                "caused_by": e.caused_by,
                "based_on": e.based_on,
                "schema": e.schema,
                "time": e.time,
                "body": encode_envelope(e),
            }
            for e in committed
        ]
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            self.db.table("events").insert_all(rows, batch_size=1000)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self._head = seq
        return committed

    def reject(self, subject: str, reason: str, body: bytes) -> None:
        """Keep a message that was not a valid event, with the reason, outside the log."""
        self._conn.execute("BEGIN IMMEDIATE")
        self.db.table("rejected").insert(
            {"received": time.time(), "subject": subject, "reason": reason, "body": body}
        )
        self._conn.execute("COMMIT")

    # -- reading -----------------------------------------------------------------------

    def read_raw(
        self, start: int = 1, stop: int | None = None, *, types: Iterable[str] | None = None
    ) -> Iterator[bytes]:
        """Committed envelope bytes with ``start <= seq <= stop``, in ``seq`` order."""
        sql = "SELECT body FROM events WHERE seq >= ?"
        args: list[object] = [start]
        if stop is not None:
            sql += " AND seq <= ?"
            args.append(stop)
        if types is not None:
            tlist = sorted(set(types))
            sql += f" AND type IN ({','.join('?' * len(tlist))})"
            args.extend(tlist)
        sql += " ORDER BY seq"
        for (body,) in self._conn.execute(sql, args):
            yield body

    def read(
        self, start: int = 1, stop: int | None = None, *, types: Iterable[str] | None = None
    ) -> Iterator[Envelope]:
        """Committed envelopes by range and, optionally, by type."""
        for body in self.read_raw(start, stop, types=types):
            yield decode_envelope(body)

    def records(self, start: int = 1, stop: int | None = None) -> Iterator[Record]:
        """Committed envelopes with their decoded events."""
        for body in self.read_raw(start, stop):
            yield Record.from_bytes(body)

    def get(self, event_id: str) -> Envelope | None:
        """One committed envelope by id."""
        row = self._conn.execute(
            "SELECT body FROM events WHERE event_id = ?", [event_id]
        ).fetchone()
        return decode_envelope(row[0]) if row else None

    def count(self) -> int:
        """Number of committed events."""
        return int(self._conn.execute("SELECT COUNT(*) FROM events").fetchone()[0])

    def rejected_count(self) -> int:
        """Number of messages kept in the rejected table."""
        return int(self._conn.execute("SELECT COUNT(*) FROM rejected").fetchone()[0])

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
