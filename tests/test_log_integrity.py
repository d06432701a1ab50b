"""The log proves itself, with real SQLite files and real processes.

The database refuses every rewrite (REPLACE, OR IGNORE, UPSERT, rows from other programs);
the hash chain finds a row changed by anyone who got past that, and `kf report`, `kf
export` and `kf replay --check` name its seq; one writer per log; a held write lock is
waited out; bad files get one-line errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from agents.archivist import Archivist
from kf import bus
from kf.agent import AgentContext
from kf.app.cli import main as kf_main
from kf.app.report import build_report, format_table
from kf.bus import EmbeddedServer
from kf.events import Envelope, decode_event, encode_envelope, make_envelope
from kf.log import (
    WRITER_FUNCTION,
    EventLog,
    LogError,
    LogIntegrityError,
    LogLocked,
    check_integrity,
)
from kf.replay import check, deciding_agent_types
from kf.runtime import Outbox
from kf.search_facts import CandidateProfiled
from tests.harness import pings, run_kf, wait_for
from tests.shared_runs import copy_log, search_run
from tests.tally import Pinged, Tally

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, KF_LOG_LEVEL="WARNING", KF_EVAL_THREADS="1", PYTHONPATH=str(ROOT))
OLD_BUSY_TIMEOUT_S = 5.0  # Python's sqlite3 default, which the archivist used to crash after


def _ping(i: int) -> Envelope:
    return make_envelope(Pinged(producer="p", n=i), run_id="r", source="p@h", event_id=f"p-{i}")


def small_log(path: Path, n: int = 12) -> Path:
    with EventLog(path) as log:
        log.append([_ping(i) for i in range(n)])
        log.reject("kf.r.in", "not an envelope", b"\xff")
    return path


def rows(path: Path) -> list[tuple[object, ...]]:
    with contextlib.closing(sqlite3.connect(path)) as c:
        return [
            *c.execute("SELECT * FROM events ORDER BY seq"),
            *c.execute("SELECT * FROM meta"),
            *c.execute("SELECT id, reason FROM rejected"),
        ]


def kf(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A `kf` command as its own process."""
    return run_kf(*args, timeout=timeout)


def outside(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Python code run as another program touching the file (not through kf)."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- the database refuses rewrites -----------------------------------------------------------


def test_log_refuses_replace_ignore_and_upsert_on_committed_rows(db_path: Path) -> None:
    """REPLACE, OR IGNORE, UPSERT, gaps and rewrites of events, meta and rejected are refused,
    even from a connection that defines kf's writer function."""
    small_log(db_path)
    before = rows(db_path)
    cols = "seq, event_id, type, source, caused_by, based_on, schema, time, body, hash"
    attempts = [
        f"INSERT OR REPLACE INTO events ({cols}) SELECT {cols} FROM events WHERE seq = 1",
        f"REPLACE INTO events ({cols}) SELECT 13, event_id, type, source, caused_by, based_on,"
        " schema, time, body, hash FROM events WHERE seq = 2",
        f"INSERT OR IGNORE INTO events ({cols}) SELECT seq, 'new-id', type, source, caused_by,"
        " based_on, schema, time, body, hash FROM events WHERE seq = 3",
        f"INSERT INTO events ({cols}) SELECT {cols} FROM events WHERE seq = 4"
        " ON CONFLICT(seq) DO UPDATE SET body = x'00'",
        f"INSERT INTO events ({cols}) SELECT 20, 'gap', type, source, caused_by, based_on,"
        " schema, time, body, hash FROM events WHERE seq = 5",
        "UPDATE events SET type = 'x' WHERE seq = 6",
        "DELETE FROM events WHERE seq = 12",
        "INSERT OR REPLACE INTO meta (key, value) VALUES ('format', 'kf-log/1')",
        "UPDATE meta SET value = 'kf-log/1'",
        "DELETE FROM meta",
        "INSERT OR REPLACE INTO rejected (id, reason) VALUES (1, 'hidden')",
        "DELETE FROM rejected",
    ]
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as c:
        c.create_function(WRITER_FUNCTION, 0, lambda: 1)
        for sql in attempts:
            with pytest.raises(sqlite3.IntegrityError, match="append-only"):
                c.execute(sql)
    assert rows(db_path) == before
    with EventLog(db_path, readonly=True) as log:
        assert log.verify().status == "verified"


def test_log_refuses_rows_inserted_by_another_program(db_path: Path) -> None:
    """A plain INSERT from another process (a sqlite tool, a candidate) is refused."""
    small_log(db_path)
    before = rows(db_path)
    script = (
        "import sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1])\n"
        'c.execute("INSERT INTO events (seq, event_id, type, source, schema, time, body, hash)'
        " VALUES (13, 'forged', 'kernel.candidate_profiled', 'profiler@x', 1, 0, x'00', 'ab')\")\n"
        "c.commit()\n"
    )
    proc = outside(script, str(db_path))
    assert proc.returncode == 1
    assert f"no such function: {WRITER_FUNCTION}" in proc.stderr
    assert rows(db_path) == before


# -- the chain finds what got past --------------------------------------------------------

_TAMPER = {
    "rewritten": ("UPDATE events SET body = (SELECT body FROM events WHERE seq = 2) WHERE seq = 7",
                  7, "columns disagree"),
    "deleted": ("DELETE FROM events WHERE seq = 4", 4, "seq 4 missing before seq 5"),
    "inserted without a hash": (
        "INSERT INTO events (seq, event_id, type, source, schema, time, body) SELECT 13,"
        " 'forged', type, source, schema, time, body FROM events WHERE seq = 12",
        13, "no chain hash"),
    "columns changed": ("UPDATE events SET type = 'kernel.candidate_profiled' WHERE seq = 3",
                        3, "columns disagree"),
}  # fmt: skip


@pytest.mark.parametrize(
    "kind", ["rewritten", "deleted", "inserted without a hash", "columns changed"]
)
def test_log_chain_names_the_first_row_changed_past_the_triggers(db_path: Path, kind: str) -> None:
    """Dropping the triggers and changing a row is found at that row's seq, by readers and
    by a writer, which refuses to extend the log."""
    small_log(db_path)
    sql, bad, problem = _TAMPER[kind]
    script = (
        "import sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "for t in ('events_no_update', 'events_no_delete', 'events_append_only'):\n"
        "    c.execute('DROP TRIGGER ' + t)\n"
        "c.execute(sys.argv[2])\n"
    )
    proc = outside(script, str(db_path), sql)
    assert proc.returncode == 0, proc.stderr
    with EventLog(db_path, readonly=True) as log:
        found = log.verify()
        assert (found.status, found.bad_seq) == ("broken", bad)
        assert problem in found.problem
        with pytest.raises(LogIntegrityError, match=f"failed at seq {bad}: "):
            check_integrity(log)
    with pytest.raises(LogIntegrityError, match=f"seq {bad}.*will not extend"):
        EventLog(db_path)


def test_log_chain_finds_a_body_rewritten_with_its_columns(db_path: Path) -> None:
    """A row whose body and columns were rewritten consistently breaks the chain there."""
    small_log(db_path)
    forged = msgspec.structs.replace(
        make_envelope(Pinged(producer="p", n=999), run_id="r", source="p@h", event_id="p-6"),
        seq=7,
    )
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as c:
        c.execute("DROP TRIGGER events_no_update")
        c.execute(
            "UPDATE events SET body = ?, time = ? WHERE seq = 7",
            [encode_envelope(forged), forged.time],
        )
    with EventLog(db_path, readonly=True) as log:
        found = log.verify()
    assert found.bad_seq == 7
    assert "chain hash does not match" in found.problem


def test_log_written_before_the_chain_is_read_and_said_unchained(db_path: Path) -> None:
    """A kf-log/1 file (no hash column) is read, reported as unchained, and extended."""
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as c:
        c.execute(
            "CREATE TABLE events (seq INTEGER PRIMARY KEY, event_id TEXT NOT NULL, type TEXT "
            "NOT NULL, source TEXT NOT NULL, caused_by TEXT, based_on INTEGER, schema INTEGER "
            "NOT NULL, time FLOAT NOT NULL, body BLOB NOT NULL)"
        )
        c.execute("CREATE UNIQUE INDEX idx_events_event_id ON events (event_id)")
        c.execute("CREATE TABLE rejected (id INTEGER PRIMARY KEY, received FLOAT, subject TEXT,"
                  " reason TEXT, body BLOB)")  # fmt: skip
        c.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
        c.execute("INSERT INTO meta VALUES ('format', 'kf-log/1')")
        for i in range(1, 6):
            e = msgspec.structs.replace(_ping(i), seq=i)
            c.execute(
                "INSERT INTO events VALUES (?,?,?,?,?,?,?,?,?)",
                [i, e.event_id, e.type, e.source, None, None, e.schema, e.time,
                 encode_envelope(e)],
            )  # fmt: skip
    report = build_report(db_path)
    assert report["integrity"]["status"] == "unchained"
    assert "unchained log" in format_table(report)
    with EventLog(db_path) as log:
        assert not log.chained
        assert [e.seq for e in log.append([_ping(6)])] == [6]
    with (
        contextlib.closing(sqlite3.connect(db_path)) as c,
        pytest.raises(sqlite3.DatabaseError, match=r"append-only|no such function"),
    ):
        c.execute("INSERT OR REPLACE INTO events SELECT * FROM events WHERE seq = 1")
    with EventLog(db_path, readonly=True) as log:
        found = log.verify()
    assert (found.status, found.events) == ("unchained", 6)


# -- a finished run's log, forged by another process ----------------------------------------


@pytest.fixture(scope="module")
def run_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real finished `kf run`'s log: the session's search run over tests/fixtures/search
    (tests/shared_runs.py, which tests/test_loop.py and tests/test_dashboard.py read too:
    one whole run fewer than a run of this module's own). Tests forge copies of it."""
    run = search_run(tmp_path_factory)
    assert run.report()["finished"]
    return run.db


def _task_of(db: Path, seq: int) -> str:
    """The task of the event at ``seq`` of ``db``'s untouched log."""
    with EventLog(db, readonly=True) as elog:
        (event,) = [decode_event(e) for e in elog.read() if e.seq == seq]
    assert isinstance(event, CandidateProfiled)
    return event.task


def forge(mode: str, db: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.forger", mode, str(db)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_forged_profile_in_a_finished_run_is_refused_by_report_export_and_replay(
    run_log: Path, tmp_path: Path
) -> None:
    """A profile rewritten to claim 99× by another process: report and export refuse, replay
    --check fails, each naming the seq; shown only when asked, marked."""
    db = copy_log(run_log, tmp_path / "forged.db")
    proc = forge("rewrite", db)
    assert proc.returncode == 0, proc.stderr
    seq = int(proc.stdout.split()[-1])
    where = f"integrity check failed at seq {seq}: chain hash does not match"

    rep = kf("report", str(db))
    assert rep.returncode == 2
    assert where in rep.stderr and len(rep.stderr.strip().splitlines()) == 1
    assert "99.00" not in rep.stdout

    out = tmp_path / "best.py"
    exp = kf("export", str(db), "-o", str(out))
    assert exp.returncode == 2 and where in exp.stderr
    assert not out.exists()

    rp = kf("replay", str(db), "--check")
    assert rp.returncode == 1
    assert f"check: FAILED at seq {seq} (integrity, kernel.candidate_profiled)" in rp.stdout

    shown = build_report(db, ignore_integrity=True)  # what the forgery would have shown
    (forged_task,) = [t for t in shown["tasks"] if t["task"] == _task_of(run_log, seq)]
    assert forged_task["best_speedup"] == pytest.approx(99.0)
    assert shown["integrity"]["bad_seq"] == seq
    assert format_table(shown).startswith(f"WARNING: {db}: log integrity check failed")
    with EventLog(run_log, readonly=True) as original:
        assert check(original, deciding_agent_types()).ok  # the untouched log still passes


def test_forged_row_inserted_into_a_finished_run_is_refused_or_found(
    run_log: Path, tmp_path: Path
) -> None:
    """A plain forged INSERT is refused by the database; one that gets past the trigger is
    found at its seq by report, export and replay."""
    db = copy_log(run_log, tmp_path / "forged.db")
    naive = forge("naive", db)
    assert naive.returncode == 1 and "no such function" in naive.stdout
    assert kf("report", str(db)).returncode == 0

    proc = forge("insert", db)
    assert proc.returncode == 0, proc.stderr
    seq = int(proc.stdout.split()[-1])
    rep = kf("report", str(db), "--json")
    assert rep.returncode == 2 and f"failed at seq {seq}: chain hash" in rep.stderr
    exp = kf("export", str(db), "-o", str(tmp_path / "x.py"))
    assert exp.returncode == 2 and f"failed at seq {seq}" in exp.stderr
    rp = kf("replay", str(db), "--check")
    assert rp.returncode == 1 and f"FAILED at seq {seq} (integrity" in rp.stdout


# -- one writer per log -------------------------------------------------------------------------


def test_log_second_writer_is_refused_until_the_first_closes(db_path: Path) -> None:
    """While a writer holds the log another writer gets LogLocked naming it; readers read."""
    first = EventLog(db_path)
    try:
        first.append([_ping(1)])
        with pytest.raises(
            LogLocked, match=f"another kf process is writing this log \\(pid {os.getpid()}"
        ):
            EventLog(db_path)
        with EventLog(db_path, readonly=True) as reader:
            assert reader.count() == 1
    finally:
        first.close()
    assert not db_path.with_name(db_path.name + ".lock").exists()
    with EventLog(db_path) as again:
        assert again.append([_ping(2)])[0].seq == 2


@pytest.fixture
def nats_url() -> Iterator[str]:
    with EmbeddedServer() as server:
        yield server.url


def test_archivist_second_process_on_one_log_is_refused(nats_url: str, db_path: Path) -> None:
    """A second `kf agent archivist` on a log another archivist process writes exits 2 with
    one line naming the holder; the first goes on."""
    args = ["agent", "archivist", "--nats", nats_url, "--run", "r", "--db", str(db_path)]
    first = subprocess.Popen(
        [sys.executable, "-m", "kf.app.cli", *args], cwd=ROOT, env=ENV,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lock = db_path.with_name(db_path.name + ".lock")
    try:
        deadline = time.monotonic() + 60
        while not (lock.exists() and f"pid {first.pid} " in lock.read_text()):
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline, "the first archivist never took the log"
            time.sleep(0.05)
        second = kf(*args, timeout=60)
        assert second.returncode == 2
        # (less the warning that this plain test server has no per-role users)
        line = "\n".join(x for x in second.stderr.strip().splitlines() if "WARNING: NATS" not in x)
        assert len(line.splitlines()) == 1 and "Traceback" not in line
        assert "another kf process is writing this log" in line and f"pid {first.pid}" in line
        assert first.poll() is None
    finally:
        first.terminate()
        first.communicate(timeout=30)


# -- a user's tool holding the write lock ------------------------------------------------------

_HOLD = (
    "import sqlite3, sys\n"
    "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "c.execute('BEGIN IMMEDIATE')\n"
    "print('locked', flush=True)\n"
    "sys.stdin.readline()\n"
    "c.execute('COMMIT')\n"
    "print('released', flush=True)\n"
)


async def test_archivist_waits_out_a_write_lock_held_longer_than_the_old_busy_timeout(
    nats_url: str, db_path: Path
) -> None:
    """A sqlite connection in another process holding BEGIN IMMEDIATE past 5 s stalls the
    archivist without crashing it; once released, everything sent meanwhile is committed."""
    nc = await bus.connect(bus.BusOptions(nats_url))
    stop, ready = asyncio.Event(), asyncio.Event()
    arch = Archivist(
        AgentContext(run_id="busy", agent_id="archivist@test"), db=db_path, hosted=[Tally], nc=nc
    )
    task = asyncio.create_task(arch.run(stop, ready))
    outbox = Outbox(nc, "busy")
    sender = asyncio.create_task(outbox.run())
    holder: asyncio.subprocess.Process | None = None
    try:
        await wait_for(ready.is_set, 30, "the archivist to be ready")
        outbox.put(pings("a", 5, "busy"))
        assert await outbox.flush(30)
        holder = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _HOLD, str(db_path),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert holder.stdin is not None and holder.stdout is not None
        assert (await holder.stdout.readline()).strip() == b"locked"
        locked_at = time.monotonic()
        outbox.put(pings("b", 50, "busy"))
        await wait_for(lambda: arch.stats.busy_waits > 0, 30, "the archivist to meet the lock")
        await wait_for(
            lambda: time.monotonic() - locked_at > OLD_BUSY_TIMEOUT_S + 1,
            30,
            "the lock to be held past the old busy timeout",
        )
        assert not task.done()
        holder.stdin.write(b"go\n")
        await holder.stdin.drain()
        assert (await holder.stdout.readline()).strip() == b"released"
        assert await outbox.flush(30)
    finally:
        if holder is not None:
            if holder.returncode is None:
                holder.kill()
            await holder.wait()
        stop.set()
        await task
        sender.cancel()
        await bus.close(nc)
    with EventLog(db_path, readonly=True) as log:
        ids = [e.event_id for e in log.read() if e.type == "test.pinged"]
        assert log.verify().status == "verified"
    assert sorted(ids) == sorted([f"a-{i}" for i in range(5)] + [f"b-{i}" for i in range(50)])


# -- bad files: one line, never a traceback ------------------------------------------------------


def _bad_files(tmp_path: Path) -> dict[str, Path]:
    good = small_log(tmp_path / "good.db", 3000)
    data = good.read_bytes()
    (tmp_path / "truncated.db").write_bytes(data[: len(data) // 2])
    (tmp_path / "random.db").write_bytes(os.urandom(8192))
    with contextlib.closing(sqlite3.connect(tmp_path / "foreign.db")) as c:
        c.execute("CREATE TABLE notes (text TEXT)")
        c.commit()
    (tmp_path / "folder.db").mkdir()
    return {
        "truncated": tmp_path / "truncated.db",
        "random bytes": tmp_path / "random.db",
        "foreign": tmp_path / "foreign.db",
        "folder": tmp_path / "folder.db",
    }


_SAYS = {
    "truncated": "the log is damaged: truncated",
    "random bytes": "not an SQLite database",
    "foreign": "not a kf event log (its tables: notes)",
    "folder": "is a folder",
}


def test_cli_bad_log_files_get_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """report, replay, export and serve on a truncated, random, foreign file or a folder exit
    2 with one line naming it."""
    for kind, path in _bad_files(tmp_path).items():
        for argv in (
            ["report", str(path)],
            ["replay", str(path), "--check"],
            ["export", str(path), "-o", str(tmp_path / "out.py")],
            ["serve", str(path), "--port", "0"],
        ):
            assert kf_main(argv) == 2, (kind, argv)
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1, (kind, argv, err)
            assert str(path) in err and _SAYS[kind] in err, (kind, argv, err)
        with pytest.raises(LogError, match=_SAYS[kind].replace("(", r"\(").replace(")", r"\)")):
            EventLog(path)
    proc = kf("report", str(tmp_path / "random.db"))  # and as its own process
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1


def test_cli_garbled_page_gets_one_printable_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bytes of a log page overwritten (an event's id, in its row and in its body, with
    bytes that are not UTF-8): replay --check, report (also --ignore-integrity), export
    end with one printable line (exit 1 or 2), never a traceback or the raw bytes."""
    data = small_log(tmp_path / "good.db", 3000).read_bytes()
    spots = [i for i in range(len(data)) if data.startswith(b"p-1500", i)]
    assert spots
    cases = {"all": spots, **{f"at{i}": [i] for i in spots}}
    for name, where in cases.items():
        garbled = bytearray(data)
        for i in where:
            garbled[i : i + 6] = b"\xff\x01\x1b[2J"
        path = tmp_path / f"garbled-{name}.db"
        path.write_bytes(garbled)
        for argv in (
            ["replay", str(path), "--check"],
            ["report", str(path)],
            ["report", str(path), "--ignore-integrity"],
            ["export", str(path), "-o", str(tmp_path / "out.py")],
        ):
            code = kf_main(argv)
            captured = capsys.readouterr()
            err = captured.err.strip()
            # one copy alone may sit where these commands never read (an index's page)
            assert code in ((1, 2) if name == "all" else (0, 1, 2)), (name, argv, captured)
            assert len(err.splitlines()) <= 1, (name, argv, err)
            shown = captured.out + captured.err
            assert "\x1b" not in shown and "\ufffd" not in shown and "Traceback" not in shown
            if code == 2 and argv[0] != "export":  # a log of pings has no task to export
                assert str(path) in err and ("damaged" in err or "integrity" in err), err


def test_cli_log_from_newer_kf_refused_at_open(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log whose format is kf-log/99 is refused by replay, report, export, serve and run
    (resume) at open, exit 2, one line naming its format, the ones this kf reads and to
    upgrade kf; none of them shows it as verified."""
    path = small_log(tmp_path / "newer.db")
    with contextlib.closing(sqlite3.connect(path)) as c:  # as a future kf would write it
        c.execute("DROP TRIGGER meta_no_update")
        c.execute("UPDATE meta SET value = 'kf-log/99' WHERE key = 'format'")
        c.commit()
    task = str(ROOT / "examples" / "tasks" / "sum_rows.py")
    for argv in (
        ["replay", str(path)],
        ["replay", str(path), "--check"],
        ["report", str(path)],
        ["export", str(path), "-o", str(tmp_path / "out.py")],
        ["serve", str(path), "--port", "0"],
        ["run", task, "--budget", "1", "--db", str(path), "--resume"],
    ):
        assert kf_main(argv) == 2, argv
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert len(err.splitlines()) == 1, (argv, err)
        assert str(path) in err and "kf-log/99" in err and "kf-log/2" in err, (argv, err)
        assert "upgrade kf" in err and "verified" not in captured.out + err, (argv, captured)
    with pytest.raises(LogError, match="newer kf"):
        EventLog(path, readonly=True)


def test_replay_garbled_body_is_one_line_and_no_finaliser_traceback(tmp_path: Path) -> None:
    """`kf replay` (and `--check`) as its own process, on a log whose event body in the
    middle is garbled, writes exactly its one line to stderr: no "Exception ignored"
    traceback from a reader left open behind it."""
    data = small_log(tmp_path / "good.db", 40).read_bytes()
    garbled = bytearray(data)
    spots = [i for i in range(len(data)) if data.startswith(b"p-25", i)]
    assert spots
    for i in spots:
        garbled[i : i + 4] = b"\xff\x01\xfe\x02"
    path = tmp_path / "garbled.db"
    path.write_bytes(garbled)
    for extra in ((), ("--check",)):
        proc = kf("replay", str(path), *extra)
        assert proc.returncode == 2, proc
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "damaged" in proc.stderr and "Exception ignored" not in proc.stderr


def test_log_path_with_hash_and_question_mark_is_one_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log named `a#b?c.db` is written, read and reported as that file, creating no other."""
    db = small_log(tmp_path / "a#b?c.db")
    with EventLog(db, readonly=True) as log:
        assert log.count() == 12 and log.verify().status == "verified"
    assert kf_main(["report", str(db)]) == 0
    assert "log chain verified: 12 events" in capsys.readouterr().out
    assert kf_main(["replay", str(db), "--check"]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert names <= {"a#b?c.db", "a#b?c.db-wal", "a#b?c.db-shm"}, names
