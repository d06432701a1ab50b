"""The threat model's attacks (docs/threat-model.md), each through the real path.

Many live beside the defence they test (the table in docs/threat-model.md names each);
this file holds the ones that had no test of their own: a task whose ``get_inputs()``
loops forever or asks for 10 GB, checked in a boxed runner; and, around one real
``kf run`` whose task is named with HTML, a second ``kf run`` on its log and edits to
the log with the sqlite3 command-line shell, during the run and after it. Each ends
with one clear line, and the run loses nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kf.evaluation.grader import box
from kf.evaluation.grader.sandbox import RunnerPool
from kf.evaluation.grader.task_check import run_task_check
from kf.kernels.tasks import TaskError, load_task
from tests.harness import kf_proc, killed_at_exit
from tests.harness import run_kf as kf

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, KF_LOG_LEVEL="WARNING", KF_EVAL_THREADS="1", PYTHONPATH=str(ROOT))
TINY_TASK = (ROOT / "tests/fixtures/eval/task_gelu.py").read_text()
HTML_NAME = "relu<img src=x onerror=alert(1)>"
BUDGET = 4

needs_box = pytest.mark.skipif(box.probe() is not None, reason=f"no runner box here: {box.probe()}")


def sqlite_cli(db: Path, sql: str) -> subprocess.CompletedProcess[str]:
    """The sqlite3 shell, as a user would run it on the log (waiting out a busy log)."""
    return subprocess.run(
        ["sqlite3", "-cmd", ".timeout 20000", str(db), sql],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# -- a task that hangs or asks for 10 GB ------------------------------------------------------


@pytest.fixture(scope="module")
def pool() -> Iterator[RunnerPool]:
    runners = RunnerPool(size=1, threads=1)
    try:
        yield runners
    finally:
        runners.close()


@needs_box
def test_hostile_get_inputs_that_loops_or_takes_10gb_is_one_line(
    tmp_path: Path, pool: RunnerPool
) -> None:
    """A task whose get_inputs() never returns, or allocates 10 GB, fails its check in the
    boxed runner with one line naming the file and the cause; the pool checks the next
    task as before."""
    hostile = {
        "loops": "    while True:\n        pass\n",
        "10gb": "    torch.ones(10 * 2**30 // 4)\n",
    }
    says = {"loops": ("timed out", "time"), "10gb": ("memory", "alloc")}
    for name, body in hostile.items():
        path = tmp_path / f"{name}.py"
        path.write_text(
            TINY_TASK.replace(
                "def get_inputs() -> list[torch.Tensor]:\n",
                "def get_inputs() -> list[torch.Tensor]:\n" + body,
            )
        )
        started = time.monotonic()
        with pytest.raises(TaskError) as caught:
            run_task_check(load_task(path), pool=pool, timeout_s=10)
        message = str(caught.value)
        assert len(message.splitlines()) == 1, message
        assert f"{name}.py" in message and any(w in message.lower() for w in says[name]), message
        assert time.monotonic() - started < 120  # bounded by the check's limit, not hung
    good = tmp_path / "good.py"
    good.write_text(TINY_TASK)
    assert run_task_check(load_task(good), pool=pool).output_shapes == [[64, 1024]]


# -- one real run, its log attacked while it runs and after -----------------------------------


def _events(db: Path) -> int:
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as c:
            return int(c.execute("SELECT count(*) FROM events").fetchone()[0])
    except sqlite3.Error:
        return 0


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``kf run`` on a task named with HTML; while it runs, a second ``kf run`` on its log
    and the sqlite3 shell's UPDATE, DELETE, INSERT and REPLACE on it."""
    tmp = tmp_path_factory.mktemp("hostile")
    tasks = tmp / "tasks"
    (tasks / "seeds").mkdir(parents=True)
    search = ROOT / "tests/fixtures/search"
    shutil.copy(search / "scale_relu.py", tasks / f"{HTML_NAME}.py")
    shutil.copy(search / "seeds/scale_relu.py", tasks / "seeds" / f"{HTML_NAME}.py")
    db = tmp / "run.db"
    args = ["run", str(tasks), "--budget", str(BUDGET), "--seed", "1", "--db", str(db)]
    args += ["--tune-budget", "0", "--max-in-flight", "1", "--json"]
    with killed_at_exit(kf_proc(*args, env=ENV)) as main:
        deadline = time.monotonic() + 240
        while _events(db) < 3:
            assert main.poll() is None, main.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run never wrote its log"
            time.sleep(0.2)
        second = kf(*args)
        running_after_second = main.poll() is None
        edits = {
            "update": sqlite_cli(db, "UPDATE events SET type = 'x' WHERE seq = 1"),
            "delete": sqlite_cli(db, "DELETE FROM events WHERE seq = 2"),
            "insert": sqlite_cli(
                db,
                "INSERT INTO events (seq, event_id, type, source, schema, time, body) "
                "VALUES (100000, 'forged', 'kernel.candidate_profiled', 'x', 1, 0, x'00')",
            ),
            "replace": sqlite_cli(db, "REPLACE INTO events SELECT * FROM events WHERE seq = 1"),
        }
        out, err = main.communicate(timeout=400)
    return {
        "db": db,
        "tmp": tmp,
        "code": main.returncode,
        "out": out,
        "err": err,
        "second": second,
        "running_after_second": running_after_second,
        "edits": edits,
    }


@needs_box
def test_hostile_second_kf_run_on_a_live_log_is_refused(live_run: dict[str, Any]) -> None:
    """A second ``kf run`` on the log of a running one exits 2 with one line naming the
    process that writes it; the first run finishes with every candidate."""
    second = live_run["second"]
    if not live_run["running_after_second"] and second.returncode == 0:
        pytest.skip("the first run ended before the second opened the log (a fast machine)")
    assert second.returncode == 2, second.stderr[-3000:]
    lines = [x for x in second.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "another kf process is writing this log" in lines[0], lines
    assert "Traceback" not in second.stderr
    assert live_run["code"] == 0, live_run["err"][-3000:]
    (task,) = json.loads(live_run["out"])["tasks"]
    assert task["task"] == HTML_NAME and task["candidates"] == BUDGET


@needs_box
def test_hostile_sqlite_shell_cannot_change_a_live_log(live_run: dict[str, Any]) -> None:
    """The sqlite3 shell's UPDATE, DELETE, INSERT and REPLACE on a running log are refused
    by the log (one error line each); nothing changed, and replay --check passes."""
    says = {
        "update": "append-only: UPDATE refused",
        "delete": "append-only: DELETE refused",
        "insert": "no such function: kf_log_append_only",
        "replace": "no such function: kf_log_append_only",
    }
    for kind, done in live_run["edits"].items():
        assert done.returncode != 0, (kind, done)
        assert says[kind] in done.stderr and len(done.stderr.strip().splitlines()) == 1, done
    assert live_run["code"] == 0, live_run["err"][-3000:]
    db = live_run["db"]
    with contextlib.closing(sqlite3.connect(db)) as c:
        assert c.execute("SELECT type FROM events WHERE seq = 1").fetchone()[0] == "run.started"
        assert c.execute("SELECT count(*) FROM events WHERE event_id = 'forged'").fetchone()[0] == 0
    check = kf("replay", str(db), "--check")
    assert check.returncode == 0 and "check: ok" in check.stdout, check.stdout + check.stderr


@needs_box
def test_hostile_sqlite_shell_past_the_triggers_is_named(
    live_run: dict[str, Any], tmp_path: Path
) -> None:
    """Dropping the log's trigger with the sqlite3 shell and rewriting a row gets past the
    database, not past the chain: report and export refuse with one line naming the seq,
    replay --check fails at it."""
    db = tmp_path / "edited.db"
    with (
        contextlib.closing(sqlite3.connect(live_run["db"])) as a,
        contextlib.closing(sqlite3.connect(db)) as b,
    ):
        a.backup(b)
    done = sqlite_cli(
        db, "DROP TRIGGER events_no_update; UPDATE events SET source = 'forged' WHERE seq = 3"
    )
    assert done.returncode == 0, done.stderr
    report = kf("report", str(db))
    assert report.returncode == 2 and len(report.stderr.strip().splitlines()) == 1
    assert "integrity check failed at seq 3" in report.stderr, report.stderr
    export = kf("export", str(db), "-o", str(tmp_path / "best.py"))
    assert export.returncode == 2 and "seq 3" in export.stderr
    replay = kf("replay", str(db), "--check")
    assert replay.returncode == 1 and "FAILED at seq 3 (integrity" in replay.stdout


@needs_box
def test_hostile_html_in_a_task_name_stays_text(live_run: dict[str, Any], tmp_path: Path) -> None:
    """A task named with an HTML tag runs, and the self-contained HTML report carries the
    name only as escaped data (the page renders it as text)."""
    assert live_run["code"] == 0, live_run["err"][-3000:]
    out = tmp_path / "report.html"
    done = kf("report", str(live_run["db"]), "--html", str(out))
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    assert "<img src=x" not in page
    assert "relu\\u003cimg src=x onerror=alert(1)>" in page
    assert HTML_NAME in done.stdout  # the terminal table shows it as it is
