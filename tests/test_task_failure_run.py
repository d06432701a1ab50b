"""`kf run` on a task whose reference fails in the middle of a candidate's verification
(on the H200, the reference could not write a large payload): every candidate still gets
a verdict, one that blames the task, and the run ends with its counts adding up."""

from __future__ import annotations

import json
from pathlib import Path

from kf.events import decode_event
from kf.log import EventLog
from tests.harness import run_kf

TASKS = Path(__file__).parent / "fixtures" / "taskfail"


def test_a_reference_failing_mid_verification_rejects_the_candidate(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    proc = run_kf("run", str(TASKS), "--budget", "2", "--db", str(db), "--json", timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with EventLog(db, readonly=True) as elog:
        events = [decode_event(e) for e in elog.read()]
    kinds = [type(e).__name__ for e in events]
    assert "ReactionFailed" not in kinds, [
        e for e in events if type(e).__name__ == "ReactionFailed"
    ]
    compiled = {e.candidate_id for e in events if type(e).__name__ == "CandidateCompiled"}
    rejected = {e.candidate_id: e for e in events if type(e).__name__ == "CandidateRejected"}
    assert compiled and compiled <= set(rejected), (compiled, rejected)
    for e in rejected.values():
        assert e.report.failure_kind == "task_error", e.report
        assert "reference failed during verification" in (e.report.error or "")
    (task,) = json.loads(proc.stdout)["tasks"]
    assert task["profiled"] + task["failed"] + task["duplicates"] == task["candidates"], task
