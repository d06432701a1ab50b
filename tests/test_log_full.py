"""A full disk under the log: one line saying so, nothing committed lost, resumable.

The disk is a real one that fills: a small tmpfs mounted in a private mount namespace
(``unshare -m``, which needs root or user namespaces; the tests skip cleanly without),
and SQLite's ``max_page_count`` where no tmpfs can be had.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kf.events import Envelope, make_envelope
from kf.log import EventLog, LogFull
from tests.tally import Pinged

ROOT = Path(__file__).resolve().parent.parent

_FILL_THEN_FREE = """
import os, sys
from pathlib import Path
from kf.events import make_envelope
from kf.log import EventLog, LogError
from tests.tally import Pinged

def pings(a, b):
    return [make_envelope(Pinged(producer="p" * 100, n=i), run_id="r", source="p@h",
                          event_id=f"p-{i}") for i in range(a, b)]

disk = Path(sys.argv[1])
log = EventLog(disk / "run.db")
log.append(pings(0, 10))
fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
try:
    while os.write(fd, b"x" * 4096):
        pass
except OSError:
    pass
os.close(fd)
try:
    log.append(pings(10, 400))
except LogError as exc:
    print("refused", type(exc).__name__, str(exc).replace(chr(10), "|"))
print("head", log.head, log.verify().status)
os.unlink(disk / "filler")
log.append(pings(10, 400))
print("resumed", log.head, log.verify().status, log.count())
log.close()
"""


def _in_tmpfs(
    size: str, disk: Path, *argv: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``argv`` run with ``disk`` a fresh tmpfs of ``size`` mounted in a private mount
    namespace, output captured; skip when this host cannot mount one."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here to mount a small tmpfs")
    disk.mkdir(parents=True, exist_ok=True)
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" || exit 97; shift 2; exec "$@"'
    env = dict(os.environ, KF_LOG_LEVEL="WARNING", KF_EVAL_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("KF_LLM_API_KEY", None)
    env.pop("OPENAI_API_KEY", None)
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", size, str(disk), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    if proc.returncode == 97 or proc.stderr.startswith("unshare:"):
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    return proc


def test_log_full_disk_refuses_one_line_and_resumes_when_freed(tmp_path: Path) -> None:
    """On a tmpfs filled to the last byte, an append is refused with LogFull, one line
    naming the file and what to do; the head and the chain are as before, and once space
    is freed the same writer appends the refused events."""
    disk = tmp_path / "disk"
    proc = _in_tmpfs("1m", disk, sys.executable, "-c", _FILL_THEN_FREE, str(disk))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("refused LogFull "), proc.stdout
    assert f"disk full writing {disk / 'run.db'}" in lines[0], lines[0]
    assert "free space" in lines[0] and "nothing committed was lost" in lines[0], lines[0]
    assert "|" not in lines[0]
    assert lines[1:] == ["head 10 verified", "resumed 400 verified 400"], proc.stdout


def _pings(a: int, b: int) -> list[Envelope]:
    return [
        make_envelope(Pinged(producer="p" * 200, n=i), run_id="r", source="p@h", event_id=f"p-{i}")
        for i in range(a, b)
    ]


def test_log_full_database_page_limit_is_log_full(tmp_path: Path) -> None:
    """Where the database may grow no more (SQLite's max_page_count, as a full disk), an
    append is refused with LogFull, one line, nothing committed lost, and goes through
    once it may grow again (runs without a tmpfs)."""
    with EventLog(tmp_path / "run.db") as log:
        log.append(_pings(0, 10))
        pages = log.conn.execute("PRAGMA page_count").fetchone()[0]
        log.conn.execute(f"PRAGMA max_page_count = {pages + 2}")
        with pytest.raises(LogFull) as refused:
            log.append(_pings(10, 300))
        said = str(refused.value)
        assert len(said.splitlines()) == 1 and "nothing committed was lost" in said, said
        assert f"disk full writing {tmp_path / 'run.db'}" in said, said
        assert log.head == 10 and log.verify().status == "verified"
        log.conn.execute("PRAGMA max_page_count = 1000000")
        assert len(log.append(_pings(10, 300))) == 290
    with EventLog(tmp_path / "run.db", readonly=True) as log:
        assert log.count() == 300 and log.verify().status == "verified"


def test_run_full_disk_ends_with_one_line(tmp_path: Path) -> None:
    """`kf run` whose --db is on a disk with room for the log's schema but not for the
    run's start ends, exit 3, with one line on stderr saying the disk is full (it used to
    wait for ever for the start to be committed)."""
    task = tmp_path / "sum_rows.py"
    source = (ROOT / "examples" / "tasks" / "sum_rows.py").read_text()
    padding = "# padding, so the run's start is larger than the disk\n" * 6000
    task.write_text(source + "\n" + padding)
    disk = tmp_path / "disk"
    proc = _in_tmpfs(
        "192k", disk, sys.executable, "-m", "kf.app.cli", "run", str(task), "--budget", "1",
        "--db", str(disk / "r.db"), timeout=120,
    )  # fmt: skip
    err = proc.stderr.strip()
    assert proc.returncode == 3, (proc.stdout, err)
    assert len(err.splitlines()) == 1, err
    assert "disk full writing" in err and str(disk / "r.db") in err, err
