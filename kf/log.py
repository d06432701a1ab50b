"""The event log: one append-only SQLite file per run, the source of truth.

WAL with ``synchronous=FULL``; ``seq`` is gapless (one writer, assigned in the appending
transaction); ``event_id`` is unique, so appending an event twice leaves one row. Messages
that could not be decoded go to a separate ``rejected`` table, so bad input is kept for
inspection and never enters the log.

The database itself refuses rewrites: triggers refuse UPDATE and DELETE, and a BEFORE
INSERT trigger refuses any row that is not ``head + 1`` with a new ``event_id`` (so
``INSERT OR REPLACE``, ``OR IGNORE`` and UPSERT cannot touch a committed row) and any row
from a connection other than kf's writer (the trigger calls a function only that
connection defines). Each row carries ``hash`` = sha256(previous row's hash ‖ body), so a
row changed by anyone who got past the triggers is found by :meth:`EventLog.verify`
(see :mod:`kf.chain`). One writer per log: the writer holds an OS lock on ``<log>.lock``
for its lifetime. ``docs/log.md`` says what this defends against and what it does not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sqlite3
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
import sqlite_utils

from kf.chain import GENESIS, ChainVerifier, Integrity, Row, link
from kf.events import Envelope, EventError, Record, decode_envelope, encode_envelope

__all__ = [
    "EventLog",
    "Integrity",
    "LogBusy",
    "LogError",
    "LogFull",
    "LogIntegrityError",
    "LogLocked",
    "LogTooNew",
    "check_integrity",
    "check_writable",
]

FORMAT = 2  # kf-log/1: unchained; kf-log/2: rows carry the hash chain
WRITER_FUNCTION = "kf_log_append_only"
"""Defined only on kf's writer connection; the insert trigger calls it, so inserts from
any other connection fail with ``no such function: kf_log_append_only``."""
BUSY_TIMEOUT_S = 0.1  # the writer's own wait inside SQLite; longer waits are the caller's
_MIN_SEQ = -(2**63)
_SQLITE_HEADER = b"SQLite format 3\x00"
_SQLITE_FULL = 13
_BUSY_CODES = (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED (and their extended codes' low byte)


class LogError(RuntimeError, ValueError):
    """The log file is missing, not a kf log, damaged, or refused a write.

    Also a ``ValueError``, so callers that turn bad input into a one-line error (``kf
    run``, ``kf agent``) print it instead of a traceback.
    """


class LogIntegrityError(LogError):
    """The log fails its chain: a row was rewritten, inserted or deleted outside kf."""


class LogTooNew(LogError):
    """The log was written by a newer kf (a format this kf does not read); upgrade kf."""


class LogFull(LogError):
    """The disk (or the database's page limit) is full: nothing of the refused write was
    committed, nothing committed was lost; free space and resume."""


class LogLocked(LogError):
    """Another kf process is writing this log."""


class LogBusy(LogError):
    """Another connection holds the database's write lock; retry later (nothing was lost)."""


_ROW_COLUMNS = "seq, event_id, type, source, caused_by, based_on, schema, time, body"
_REFUSED = (
    "kf event log is append-only: a row is added only by kf''s writer, at seq head+1, "
    "with a new event_id (INSERT OR REPLACE, OR IGNORE and UPSERT on committed rows "
    "are refused)"
)


def _insert_trigger(chained: bool) -> str:
    hash_check = " OR NEW.hash IS NULL" if chained else ""
    return (
        "CREATE TRIGGER IF NOT EXISTS events_append_only BEFORE INSERT ON events "
        f"WHEN {WRITER_FUNCTION}() IS NOT 1"
        " OR NEW.seq IS NOT (SELECT COALESCE(MAX(seq), 0) + 1 FROM events)"
        " OR EXISTS (SELECT 1 FROM events WHERE event_id = NEW.event_id)"
        f"{hash_check} BEGIN SELECT RAISE(ABORT, '{_REFUSED}'); END"
    )


def _no_change_triggers(table: str) -> list[str]:
    return [
        f"CREATE TRIGGER IF NOT EXISTS {table}_no_update BEFORE UPDATE ON {table} BEGIN "
        f"SELECT RAISE(ABORT, 'kf event log is append-only: UPDATE refused'); END",
        f"CREATE TRIGGER IF NOT EXISTS {table}_no_delete BEFORE DELETE ON {table} BEGIN "
        f"SELECT RAISE(ABORT, 'kf event log is append-only: DELETE refused'); END",
    ]


_SCHEMA = [
    "CREATE TABLE events (seq INTEGER PRIMARY KEY, event_id TEXT NOT NULL, type TEXT NOT NULL,"
    " source TEXT NOT NULL, caused_by TEXT, based_on INTEGER, schema INTEGER NOT NULL,"
    " time FLOAT NOT NULL, body BLOB NOT NULL, hash TEXT)",
    "CREATE UNIQUE INDEX idx_events_event_id ON events (event_id)",
    "CREATE INDEX idx_events_type_seq ON events (type, seq)",
    "CREATE INDEX idx_events_caused_by ON events (caused_by)",
    "CREATE TABLE rejected (id INTEGER PRIMARY KEY, received FLOAT, subject TEXT,"
    " reason TEXT, body BLOB)",
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",
    f"INSERT INTO meta (key, value) VALUES ('format', 'kf-log/{FORMAT}')",
]


def _guards(chained: bool) -> list[str]:
    """Triggers every log gets (added to older logs when a writer opens them)."""
    return [
        *_no_change_triggers("events"),
        _insert_trigger(chained),
        *_no_change_triggers("meta"),
        "CREATE TRIGGER IF NOT EXISTS meta_append_only BEFORE INSERT ON meta "
        "WHEN EXISTS (SELECT 1 FROM meta WHERE key = NEW.key) "
        "BEGIN SELECT RAISE(ABORT, 'kf event log is append-only: meta keys are written once');"
        " END",
        *_no_change_triggers("rejected"),
        "CREATE TRIGGER IF NOT EXISTS rejected_append_only BEFORE INSERT ON rejected "
        "WHEN EXISTS (SELECT 1 FROM rejected WHERE id = NEW.id) "
        "BEGIN SELECT RAISE(ABORT, 'kf event log is append-only: rejected rows are kept');"
        " END",
    ]


def _file_problem(path: Path) -> str | None:
    """Why an existing file cannot be a log, judged from its first bytes; None if it may be."""
    try:
        size = path.stat().st_size
        if size == 0:
            return None
        with path.open("rb") as f:
            head = f.read(100)
    except OSError as exc:
        return f"cannot read the log ({exc.strerror or exc})"
    if len(head) < 100 or not head.startswith(_SQLITE_HEADER):
        return "not a kf event log: not an SQLite database (no SQLite header)"
    page = int.from_bytes(head[16:18], "big")
    page = 65536 if page == 1 else page
    pages = int.from_bytes(head[28:32], "big")
    header_valid = head[24:28] == head[92:96]
    wal = path.with_name(path.name + "-wal")
    if header_valid and not wal.exists() and page and size < page * pages:
        return (
            f"the log is damaged: truncated to {size} bytes, its header says "
            f"{page * pages}; restore it from a copy"
        )
    return None


def _sqlite_problem(exc: sqlite3.Error) -> str:
    # a garbled page's bytes can come back in SQLite's message: never print them raw
    text = "".join(c if c.isprintable() and c != "\ufffd" else "?" for c in str(exc))[:200]
    if "Could not decode to UTF-8" in text:
        return "damaged (a text column holds bytes that are not UTF-8); restore it from a copy"
    if "file is not a database" in text:
        return "not an SQLite database"
    if "malformed" in text or "disk I/O" in text:
        return f"damaged ({text}); restore it from a copy"
    return text


def _is_full(exc: sqlite3.Error) -> bool:
    """Whether SQLite refused a write because the disk (or the page limit) is full."""
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    return code == _SQLITE_FULL or "disk is full" in str(exc)


class _WriterLock:
    """An exclusive ``flock`` on ``<log>.lock``, held by the log's writer for its lifetime."""

    def __init__(self, log_path: Path) -> None:
        self.path = log_path.with_name(log_path.name + ".lock")
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 512).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise LogLocked(
                    f"{log_path}: another kf process is writing this log ({holder}); one "
                    "writer per log: wait for it to finish or stop it, or use another --db"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            # the previous holder may have removed the file between our open and our lock
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        argv = " ".join(sys.argv)[:200]
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}: {argv}\n".encode())

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)  # closing releases the lock


def check_writable(log_path: Path) -> None:
    """Raise :class:`LogLocked` (one line naming the holder) when another process writes
    ``log_path`` now: for a command to refuse before it starts anything (a second ``kf
    run`` on one ``--db``). The lock is taken and given back at once."""
    if log_path.exists():
        _WriterLock(log_path).release()


class EventLog:
    """An append-only event log in one SQLite file. Not thread-safe: one writer task owns it."""

    def __init__(self, path: str | Path, *, create: bool = True, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self._lock: _WriterLock | None = None
        self._conn: sqlite3.Connection | None = None
        self._pending_rejects: list[tuple[float, str, str, bytes]] = []
        if self.path.is_dir():
            raise LogError(f"{self.path}: is a folder, not an event log; pass the log file")
        exists = self.path.exists()
        if not exists and (readonly or not create):
            raise LogError(f"{self.path}: no such event log")
        if exists and (problem := _file_problem(self.path)):
            raise LogError(f"{self.path}: {problem}")
        try:
            if not readonly:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._lock = _WriterLock(self.path)
            self._open()
        except sqlite3.Error as exc:
            self.close()
            if _is_full(exc):
                raise self._full(exc) from None
            raise LogError(f"{self.path}: cannot open the log: {_sqlite_problem(exc)}") from None
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        if self.readonly:
            uri = "file:" + quote(str(self.path.absolute())) + "?mode=ro"
            conn = sqlite3.connect(uri, uri=True, isolation_level=None)
        else:
            conn = sqlite3.connect(
                str(self.path.absolute()), timeout=BUSY_TIMEOUT_S, isolation_level=None
            )
            conn.create_function(WRITER_FUNCTION, 0, lambda: 1, deterministic=True)
        self._conn = conn
        self.db = sqlite_utils.Database(conn)
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables or self.readonly:
            self.format = self._format(tables)  # before anything changes another's database
            if self.format > FORMAT:  # refused at open, by readers too: never "verified"
                raise LogTooNew(
                    f"{self.path}: written by a newer kf (format kf-log/{self.format}); this "
                    f"kf reads kf-log/1 to kf-log/{FORMAT}: upgrade kf to read or extend it"
                )
        if not self.readonly:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            if not tables:
                self._transaction([*_SCHEMA, *_guards(True)])
                self.format = FORMAT
        self.chained = any(r[1] == "hash" for r in conn.execute("PRAGMA table_info(events)"))
        if not self.readonly:
            have = {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'")
            }
            missing = [sql for sql in _guards(self.chained) if sql.split()[5] not in have]
            if missing:  # an older log: give it the guards this version has
                self._transaction(missing)
        self._head: int = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()[0]
        self._verifier = ChainVerifier(chained=self.chained)
        self._prev = GENESIS
        if not self.readonly:
            found = self.verify()
            if not found.ok:
                raise LogIntegrityError(
                    f"{found.message()}; kf will not extend a log that fails its chain "
                    "(keep it for inspection and start again with another --db)"
                )
            self._prev = self._verifier.prev

    def _format(self, tables: set[str]) -> int:
        conn = self.conn
        if "events" not in tables or "meta" not in tables:
            held = ", ".join(sorted(tables)) or "none"
            raise LogError(f"{self.path}: not a kf event log (its tables: {held})")
        row = conn.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
        value = str(row[0]) if row else ""
        name, _, version = value.partition("/")
        if name != "kf-log" or not version.isdigit():
            raise LogError(f"{self.path}: not a kf event log (format {value or 'missing'!r})")
        return int(version)

    def _transaction(self, statements: Sequence[str]) -> None:
        conn = self.conn
        self._begin()
        try:
            for sql in statements:
                conn.execute(sql)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            if _is_full(exc):
                raise self._full(exc) from None
            raise
        except BaseException:
            self._rollback()
            raise

    def _rollback(self) -> None:
        """End the write transaction this writer began, unless SQLite ended it already: on
        a full disk or an I/O error during COMMIT it rolls back by itself, and a second
        ROLLBACK would only hide why ("no transaction is active")."""
        conn = self.conn
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):  # the first error is the one to tell
                conn.execute("ROLLBACK")

    def _full(self, exc: sqlite3.Error) -> LogFull:
        return LogFull(
            f"disk full writing {self.path} ({exc}): free space on its disk and resume "
            "(the same --db); nothing committed was lost"
        )

    @property
    def conn(self) -> sqlite3.Connection:
        """The open SQLite connection."""
        if self._conn is None:
            raise LogError(f"{self.path}: the log is closed")
        return self._conn

    # -- integrity -------------------------------------------------------------------------

    def verify(self) -> Integrity:
        """Check the chain over every row committed since the last call (all rows at first).

        Never raises for a broken chain: the result names the first bad ``seq``. A row
        changed after it was verified is found by a fresh :class:`EventLog`, not by a
        later call on this one.
        """
        v = self._verifier
        if v.bad_seq is None:
            after = v.last_seq if v.events else _MIN_SEQ
            hash_col = "hash" if self.chained else "NULL"
            sql = f"SELECT {_ROW_COLUMNS}, {hash_col} FROM events WHERE seq > ? ORDER BY seq"
            try:
                for row in self.conn.execute(sql, [after]):
                    if not v.feed(row):
                        break
            except sqlite3.DatabaseError as exc:
                raise self._damaged(exc) from None
        return v.result(str(self.path))

    @property
    def head_hash(self) -> str:
        """The chain hash of the last row this writer committed or verified ("" if none)."""
        return self._prev.hex() if self.chained and self._head else ""

    # -- writing -----------------------------------------------------------------------

    @property
    def head(self) -> int:
        """The highest committed ``seq`` (0 for an empty log)."""
        return self._head

    def append(self, envelopes: Sequence[Envelope]) -> list[Envelope]:
        """Commit new envelopes in one transaction; return them with ``seq`` assigned.

        Envelopes whose ``event_id`` is already in the log (or repeated in the batch) are
        skipped: the result holds only what this call committed. Raises :class:`LogBusy`,
        having committed nothing, while another connection holds the write lock.
        """
        if self.readonly:
            raise LogError(f"{self.path}: opened read-only")
        if not envelopes and not self._pending_rejects:
            return []
        conn = self.conn
        ids = [e.event_id for e in envelopes]
        existing: set[str] = set()
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            existing.update(
                r[0]
                for r in conn.execute(
                    f"SELECT event_id FROM events WHERE event_id IN ({marks})", chunk
                )
            )
        committed: list[Envelope] = []
        rows: list[Row] = []
        seq, prev = self._head, self._prev
        for env in envelopes:
            if env.event_id in existing:
                continue
            existing.add(env.event_id)
            seq += 1
            e = msgspec.structs.replace(env, seq=seq)
            committed.append(e)
            body = encode_envelope(e)
            digest: str | None = None
            if self.chained:
                prev = link(prev, body)
                digest = prev.hex()
            rows.append(
                (seq, e.event_id, e.type, e.source, e.caused_by, e.based_on, e.schema, e.time,
                 body, digest)
            )  # fmt: skip
        if not rows and not self._pending_rejects:
            return []
        self._begin()
        try:
            if rows:
                conn.executemany(
                    f"INSERT INTO events ({_ROW_COLUMNS}, hash) VALUES (?,?,?,?,?,?,?,?,?,?)"
                    if self.chained
                    else f"INSERT INTO events ({_ROW_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)",
                    rows if self.chained else [r[:9] for r in rows],
                )
            self._write_rejects()
            conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            self._rollback()
            if _is_full(exc):
                raise self._full(exc) from None
            raise LogError(f"{self.path}: the log refused the append: {exc}") from None
        except BaseException:
            self._rollback()
            raise
        self._pending_rejects.clear()
        self._head, self._prev = seq, prev
        return committed

    def _begin(self) -> None:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
            if code in _BUSY_CODES or "locked" in str(exc):
                raise LogBusy(
                    f"{self.path}: another connection holds the log's write lock ({exc})"
                ) from None
            if _is_full(exc):
                raise self._full(exc) from None
            raise LogError(f"{self.path}: cannot write the log: {_sqlite_problem(exc)}") from None

    def _write_rejects(self) -> None:
        if self._pending_rejects:
            self.conn.executemany(
                "INSERT INTO rejected (received, subject, reason, body) VALUES (?,?,?,?)",
                self._pending_rejects,
            )

    def reject(self, subject: str, reason: str, body: bytes) -> None:
        """Keep a message that was not a valid event, with the reason, outside the log.

        While another connection holds the write lock the message is kept in memory and
        written with the next commit.
        """
        self._pending_rejects.append((time.time(), subject, reason, body))
        try:
            self._begin()
        except LogBusy:
            return
        try:
            self._write_rejects()
            self.conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._rollback()
            if _is_full(exc):
                raise self._full(exc) from None
            raise
        except BaseException:
            self._rollback()
            raise
        self._pending_rejects.clear()

    # -- reading -----------------------------------------------------------------------

    def _damaged(self, exc: sqlite3.Error) -> LogError:
        return LogError(f"{self.path}: cannot read the log: {_sqlite_problem(exc)}")

    def _query(self, sql: str, args: Sequence[object] = ()) -> Iterator[tuple[Any, ...]]:
        # a plain loop, not ``yield from``: a reader abandoned half-way (its caller raised
        # on a garbled body) is finalised after the log is closed, and ``yield from`` would
        # then close the cursor of a closed connection, an "Exception ignored" traceback
        try:
            rows = self.conn.execute(sql, args)
        except sqlite3.DatabaseError as exc:
            raise self._damaged(exc) from None
        while True:
            try:
                row = next(rows, None)
            except sqlite3.DatabaseError as exc:
                raise self._damaged(exc) from None
            if row is None:
                return
            yield row

    def _scalar(self, sql: str) -> int:
        for (n,) in self._query(sql):
            return int(n)
        return 0

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
        for (body,) in self._query(sql, args):
            yield body

    def read(
        self, start: int = 1, stop: int | None = None, *, types: Iterable[str] | None = None
    ) -> Iterator[Envelope]:
        """Committed envelopes by range and, optionally, by type; a body that is not an
        envelope (a garbled page) is :class:`LogError`, one line."""
        for body in self.read_raw(start, stop, types=types):
            try:
                yield decode_envelope(body)
            except EventError as exc:
                why = str(exc).splitlines()[0][:160]
                raise LogError(
                    f"{self.path}: the log is damaged: a committed event cannot be read "
                    f"({why}); restore it from a copy"
                ) from None

    def records(self, start: int = 1, stop: int | None = None) -> Iterator[Record]:
        """Committed envelopes with their decoded events."""
        for body in self.read_raw(start, stop):
            yield Record.from_bytes(body)

    def row_type(self, seq: int) -> str | None:
        """The ``type`` column of the row at ``seq`` (None if there is none)."""
        for (type_,) in self._query("SELECT type FROM events WHERE seq = ?", [seq]):
            return str(type_)
        return None

    def get(self, event_id: str) -> Envelope | None:
        """One committed envelope by id."""
        for (body,) in self._query("SELECT body FROM events WHERE event_id = ?", [event_id]):
            return decode_envelope(body)
        return None

    def count(self) -> int:
        """Number of committed events."""
        return int(self._scalar("SELECT COUNT(*) FROM events"))

    def rejected_count(self) -> int:
        """Number of messages kept in the rejected table (and any waiting to be written)."""
        return int(self._scalar("SELECT COUNT(*) FROM rejected")) + len(self._pending_rejects)

    def close(self) -> None:
        """Close the connection and release the writer's lock."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_integrity(elog: EventLog, *, ignore: bool = False) -> Integrity:
    """Verify ``elog``'s chain; raise :class:`LogIntegrityError` if it fails, unless ``ignore``."""
    found = elog.verify()
    if not found.ok and not ignore:
        raise LogIntegrityError(
            f"{found.message()}; the log was changed outside kf, so its results are not "
            "shown (--ignore-integrity shows them, marked)"
        )
    return found
