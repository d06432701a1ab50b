"""Remote workers a run cannot rely on: one that never answers, one that no other device
can check (issue 43, NX9 and the lone worker).

Each test is one real run on a role-separated nats-server (per-run users, as ``kf run``
makes for its embedded server): ``kf run --no-worker`` hosting the archivist and the
mutator, and remote workers with their own credentials, as real processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from kf.auth import RunCredentials
from kf.bus import EmbeddedServer
from tests.harness import piped
from tests.test_faults import (
    ENV,
    check_counted_once,
    finish,
    of_type,
    run_args,
    stop,
    wait_until,
)

SILENT = "aa-silent"  # sorts first: the archive gives the first seed to it


def _logins(creds: RunCredentials) -> dict[str, str]:
    return {
        f"KF_NATS_{role.upper()}_{what}": value
        for role in ("archivist", "proposer")
        for what, value in (
            ("USER", creds.credential(role).user),
            ("PASSWORD", creds.credential(role).password),
        )
    }


def _worker(url: str, run: str, creds: RunCredentials, name: str, env: dict[str, str]) -> Any:
    """``kf worker --name NAME`` with its own credentials."""
    cred = creds.credential("worker", name)
    args = ["worker", "--nats", url, "--run", run, "--name", name, "--heartbeat", "0.5"]
    login = {"KF_NATS_USER": cred.user, "KF_NATS_PASSWORD": cred.password}
    return piped([sys.executable, "-m", "kf.app.cli", *args], env={**ENV, **env, **login})


def _kf_run(url: str, db: Path, run: str, creds: RunCredentials, *extra: str, **env: str) -> Any:
    args = run_args(url, db, run, 2, "--no-worker", *extra)
    return piped([sys.executable, "-m", "kf.app.cli", *args], env={**ENV, **_logins(creds), **env})


def test_worker_trust_silent_worker_assignment_is_redispatched(tmp_path: Path) -> None:
    """A worker that announces itself and heartbeats but answers nothing gets the first
    seed; past the assignment timeout it is recorded lost with the reason, kf run says
    so in one line, the seed goes to an honest worker, and the run ends with every
    candidate counted once (replay --check passes)."""
    run, db = "silent", tmp_path / "run.db"
    creds = RunCredentials.generate(run, devices=[SILENT, "wB"])
    silent = creds.credential("worker", SILENT)
    login = (silent.user, silent.password, SILENT)
    procs: list[subprocess.Popen[str]] = []
    with EmbeddedServer(credentials=creds) as server:
        try:
            # long enough for the honest worker's slowest stage on a loaded machine (a
            # device answering nothing for that long is lost, honest or not)
            main = _kf_run(server.url, db, run, creds, "--assignment-timeout", "20")
            mute = piped(
                [sys.executable, "-m", "tests.silent_worker", server.url, run, *login],
                env=ENV,
            )
            procs = [main, mute]
            wait_until(
                lambda: of_type(db, "search.candidate_assigned"),
                120,
                "the first assignment",
            )
            procs.append(_worker(server.url, run, creds, "wB", {}))
            code, _, err = finish(main, 240)
        finally:
            stop(*procs)
    assert code == 0, err[-3000:]
    first = of_type(db, "search.candidate_assigned")[0]
    assert first.device_id == SILENT
    (lost,) = [x for x in of_type(db, "device.lost") if x.device_id == SILENT]
    assert "no answer to its 1 assignment(s)" in lost.reason, lost
    assert "while it still heartbeats" in lost.reason
    assert f"device {SILENT} lost: no answer" in err, err[-3000:]  # --json: progress
    again = [
        a for a in of_type(db, "search.candidate_assigned") if a.candidate_id == first.candidate_id
    ]
    assert [a.device_id for a in again] == [SILENT, "wB"], again
    check_counted_once(db, 2)


def _lone(tmp_path: Path, *extra: str) -> tuple[int, str, str, Path]:
    """A run whose only worker is one remote ``kf worker`` (``wB``), no device trusted
    but the run's own (it has none here)."""
    run, db = "lone", tmp_path / "run.db"
    creds = RunCredentials.generate(run, devices=["wB"])
    trust = {"KF_TRUSTED_DEVICES": ""}  # the suite trusts every device unless told
    procs: list[subprocess.Popen[str]] = []
    with EmbeddedServer(credentials=creds) as server:
        try:
            main = _kf_run(server.url, db, run, creds, *extra, **trust)
            procs = [main, _worker(server.url, run, creds, "wB", trust)]
            code, out, err = finish(main, 180)
        finally:
            stop(*procs)
    return code, out, err, db


def test_worker_trust_lone_worker_result_is_held_and_says_how_to_trust(tmp_path: Path) -> None:
    """With one remote worker and no device to check it, its correct seed is held
    unconfirmed, and kf run says so, why, and how to take its word (--trust wB), not
    only that every seed failed."""
    code, _, err, db = _lone(tmp_path)
    assert code == 0, err[-3000:]
    assert of_type(db, "search.confirmation_requested")
    assert "held unconfirmed — " in err and "--trust wB" in err, err[-3000:]  # progress
    assert "result(s) held unconfirmed, not failed: only wB measured them" in err


def test_worker_trust_trusted_lone_worker_results_count(tmp_path: Path) -> None:
    """``kf run --trust wB`` records wB among the run's trusted devices; its results are
    taken on its word: no confirmation asked, the seed is an elite and the best."""
    code, out, err, db = _lone(tmp_path, "--trust", "wB")
    assert code == 0, err[-3000:]
    (started,) = of_type(db, "run.started")
    assert started.config["confirm_trusted"] == ["wB"]
    assert not of_type(db, "search.confirmation_requested")
    assert of_type(db, "search.elite_admitted")
    assert json.loads(out)["tasks"][0]["best_speedup"] is not None
