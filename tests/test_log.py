"""The SQLite event log: append-only, gapless, deduplicated, readable by range and type."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kf.events import make_envelope
from kf.log import EventLog, LogError
from tests.tally import Pinged, Tallied


def _ping(i: int, eid: str | None = None):
    return make_envelope(Pinged(producer="p", n=i), run_id="r", source="p@h", event_id=eid)


def test_log_same_event_appended_twice_leaves_one_row(db_path: Path) -> None:
    """Appending an event whose id is already committed is a no-op."""
    with EventLog(db_path) as log:
        env = _ping(1, "same")
        assert len(log.append([env])) == 1
        assert log.append([env]) == []
        assert log.append([env, env]) == []
        assert log.count() == 1


def test_log_seq_is_gapless_across_duplicates(db_path: Path) -> None:
    """seq numbers run 1..N with no gaps even when duplicates are skipped in a batch."""
    with EventLog(db_path) as log:
        log.append([_ping(0, "a"), _ping(1, "b")])
        log.append([_ping(2, "b"), _ping(3, "c"), _ping(4, "a"), _ping(5, "d")])
        assert [e.seq for e in log.read()] == [1, 2, 3, 4]
        assert [e.event_id for e in log.read()] == ["a", "b", "c", "d"]


def test_log_refuses_update_and_delete(db_path: Path) -> None:
    """The database itself refuses to change or remove committed events."""
    with EventLog(db_path) as log:
        log.append([_ping(1)])
    conn = sqlite3.connect(db_path)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("UPDATE events SET type = 'x'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("DELETE FROM events")
    conn.close()


def test_log_uses_wal_and_full_sync(db_path: Path) -> None:
    """The log is opened in WAL mode with synchronous=FULL."""
    with EventLog(db_path) as log:
        assert log.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert log.db.execute("PRAGMA synchronous").fetchone()[0] == 2


def test_log_reads_by_range_and_type(db_path: Path) -> None:
    """Range and type filters return exactly the matching events in seq order."""
    with EventLog(db_path) as log:
        envs = [_ping(i) for i in range(5)]
        envs.insert(2, make_envelope(Tallied(count=2, total=1), run_id="r", source="t@h"))
        log.append(envs)
        assert [e.seq for e in log.read(2, 4)] == [2, 3, 4]
        assert [e.seq for e in log.read(types=["test.tallied"])] == [3]
        assert [r.event for r in log.records(3, 3)] == [Tallied(count=2, total=1)]


def test_log_survives_reopen(db_path: Path) -> None:
    """A reopened log continues seq where it stopped."""
    with EventLog(db_path) as log:
        log.append([_ping(1), _ping(2)])
    with EventLog(db_path) as log:
        assert log.head == 2
        assert log.append([_ping(3)])[0].seq == 3


def test_log_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    """Opening a log that does not exist read-only names the path."""
    with pytest.raises(LogError, match="no such event log"):
        EventLog(tmp_path / "nope.db", readonly=True)
