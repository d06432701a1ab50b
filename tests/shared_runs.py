"""Whole `kf run`s whose logs several test modules assert on, made once per test session.

A whole run costs 30-100 s on CI's 2 cores, so modules that need the same run share it
(issue 31, item 7): the first test that asks makes it, under a file lock in the session's
temporary root, and every later test (in this process or, under pytest-xdist, in
another worker) reads the same log, report and output. Tests only read the log; a test
that appends copies it first (``copy_log``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from filelock import FileLock

from tests.harness import kf_proc, killed_at_exit

ROOT = Path(__file__).resolve().parent.parent
SEARCH = ROOT / "tests/fixtures/search"
#: the search run's --tune-budget (kf run's default is 12)
SEARCH_TUNE_BUDGET = 4


@dataclass(frozen=True)
class SearchRun:
    """`kf run tests/fixtures/search --budget 4 --seed 3 --tune-budget 4 --json --serve`
    (offline mutator; 4 configurations tuned, the least that tunes a shape set, not the
    default 12, which tests/test_loop.py checks on the command line's parser: the
    default's timings were half the run): its log, exit status, output, and the
    dashboard's ``api/state`` fetched while the run went on."""

    db: Path
    returncode: int
    stdout: str
    stderr: str
    served_state: dict[str, Any] | None

    def report(self) -> dict[str, Any]:
        """``--json``'s report (fails the test, with kf's stderr, if the run failed)."""
        assert self.returncode == 0, self.stderr[-4000:]
        result: dict[str, Any] = json.loads(self.stdout)
        return result


def copy_log(src: Path, dst: Path) -> Path:
    """A consistent copy of a log (SQLite's backup API), so a test may append to it."""
    with (
        contextlib.closing(sqlite3.connect(src)) as a,
        contextlib.closing(sqlite3.connect(dst)) as b,
    ):
        a.backup(b)
    return dst


def session_root(factory: pytest.TempPathFactory) -> Path:
    """The session's temporary root, one for all pytest-xdist workers."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


async def _get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def _make_search_run(folder: Path) -> dict[str, Any]:
    db = folder / "run.db"
    args = ["run", str(SEARCH), "--budget", "4", "--seed", "3"]
    args += ["--tune-budget", str(SEARCH_TUNE_BUDGET)]
    args += ["--db", str(db), "--json", "--serve", "--serve-port", "0"]
    # the device measured, as outside the suite (tests/test_loop.py asserts the figure)
    env = dict(os.environ, KF_LOG_LEVEL="WARNING", KF_EVAL_THREADS="1", KF_DEVICE_MEASURE="1")
    env.pop("KF_LLM_API_KEY", None)
    env.pop("OPENAI_API_KEY", None)
    state, head = None, []
    with killed_at_exit(kf_proc(*args, env=env)) as proc:
        assert proc.stderr is not None
        for line in proc.stderr:  # with --json the progress (and the URL) go to stderr
            head.append(line)
            if "dashboard: http://" in line:
                url = line.split("dashboard: ", 1)[1].split()[0]
                state = asyncio.run(_get_json(url + "api/state"))
                break
        out, err = proc.communicate(timeout=600)
    return {
        "db": str(db),
        "returncode": proc.returncode,
        "stdout": out,
        "stderr": "".join(head) + err,
        "served_state": state,
    }


def search_run(factory: pytest.TempPathFactory) -> SearchRun:
    """The session's search run over tests/fixtures/search (made on first use)."""
    root = session_root(factory)
    folder = root / "shared-search-run"
    done = folder / "result.json"
    with FileLock(str(root / "shared-search-run.lock")):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(_make_search_run(folder)))
    data = json.loads(done.read_text())
    return SearchRun(
        db=Path(data["db"]),
        returncode=data["returncode"],
        stdout=data["stdout"],
        stderr=data["stderr"],
        served_state=data["served_state"],
    )
