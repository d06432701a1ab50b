"""The user's path, end to end on a CPU: `kf run` on a seedless task with an LLM.

A scripted OpenAI-compatible server (tests/llm_server.py; labelled ``scripted``, it replays
answers kf's developers wrote, shaped like real models' answers) answers the first
generation with a kernel that does not compile and one that is wrong; kf asks again with
both failures' evidence, gets a correct kernel (and an answer cut off at the token limit),
then mutates it. The run must end with a verified, profiled kernel written through the
LLM path, and `kf replay --check` must pass with the server stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness import logged, replay_check, scripted_llm_run, seedless_scale_relu
from tests.scripted_answers import CpuResponder


@pytest.fixture(scope="module")
def seedless_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, Any], str, CpuResponder]:
    """One seedless run (--init 2, budget 6, no tuning: tests/test_tuning.py tunes an
    LLM-written template), the scripted server stopped afterwards."""
    db = tmp_path_factory.mktemp("seedless") / "run.db"
    task = seedless_scale_relu(db.parent / "tasks")
    responder = CpuResponder()
    report, url = scripted_llm_run(
        responder, task, db, "--budget", "6", "--init", "2", "--seed", "3",
        "--max-in-flight", "2", "--tune-budget", "0", timeout=400,
    )  # fmt: skip
    return db, report, url, responder


def test_seedless_run_ends_with_a_verified_llm_kernel(seedless_run: Any) -> None:
    """The task is not skipped: its best kernel was written through the LLM path, verified
    and profiled, and says which server wrote it."""
    db, report, url, _ = seedless_run
    assert report["finished"] is True
    (task,) = report["tasks"]
    assert task["skipped"] is None
    assert task["best_speedup"] is not None and task["best_ms"] > 0
    proposed = {c.candidate_id: c for c in logged(db, "kernel.candidate_proposed")}
    best = proposed[task["best_candidate_id"]]
    assert best.mutator == f"llm: scripted via {url}"
    # the run tunes nothing (--tune-budget 0): every candidate came through the LLM path
    assert {c.operator for c in proposed.values()} <= {"init", "diff", "rewrite"}
    assert all(c.mutator.startswith("llm: scripted via ") for c in proposed.values())
    verified = {v.candidate_id for v in logged(db, "kernel.candidate_verified")}
    assert best.candidate_id in verified


def test_seedless_first_generation_is_recorded_decisions(seedless_run: Any) -> None:
    """The first generation and the retry round are init selections in C++ (the CPU's
    language); the retry names the failed candidates whose evidence it carries."""
    db, _, _, _ = seedless_run
    inits = [s for s in logged(db, "search.parent_selected") if s.operator == "init"]
    assert len(inits) == 4
    assert {s.language for s in inits} == {"cpp"}
    first, retry = inits[:2], inits[2:]
    assert all(not s.evidence for s in first)
    assert all(len(s.evidence) == 2 for s in retry)
    failed = {c.candidate_id for c in logged(db, "kernel.candidate_proposed")} & set(
        retry[0].evidence
    )
    assert len(failed) == 2


def test_seedless_retry_prompt_carries_the_failures_evidence(seedless_run: Any) -> None:
    """The retry prompt shows the compiler's error line and the failing trial's error."""
    db, _, _, responder = seedless_run
    assert responder.evidence_seen, "no retry prompt reached the server"
    text = responder.evidence_seen[0]
    assert "not declared" in text and "max abs err" in text and "atol" in text
    calls = [c for c in logged(db, "llm.called") if c.purpose == "init"]
    assert len(calls) == 4 and all(c.prompt_tokens_estimated > 0 for c in calls)


def test_seedless_cut_off_answer_is_recorded_as_such(seedless_run: Any) -> None:
    """An answer cut off at the token limit is recorded with finish_reason=length and its
    failed mutation says so."""
    db, _, _, _ = seedless_run
    cut = [c for c in logged(db, "llm.called") if c.finish_reason == "length"]
    assert len(cut) == 1
    reasons = [m.reason for m in logged(db, "kernel.mutation_failed")]
    assert any("finish_reason=length" in r for r in reasons), reasons


def test_seedless_every_candidate_ends_with_an_outcome(seedless_run: Any) -> None:
    """No candidate is left waiting: each was profiled, failed with a cause, or was found
    the same code as an earlier one (a duplicate, never run)."""
    db, report, _, _ = seedless_run
    from kf.app.report import build_report

    (task,) = build_report(db)["tasks"]
    assert task["profiled"] + task["failed"] + task["duplicates"] == task["candidates"]
    assert task["failures"].get("compile_error", 0) >= 1
    assert sum(task["failures"].values()) == task["failed"]
    assert report["run_stats"]["llm_calls"] >= 5
    stats = report["run_stats"]
    for device in stats["devices"].values():  # where each evaluator's seconds went
        assert 0 < device["building_s"] <= device["busy_s"] + 1e-6
        assert 0 < device["verifying_s"] <= device["busy_s"] + 1e-6
        assert device["building_per_candidate_s"] > 0
        assert abs(device["idle_s"] + device["busy_s"] - stats["span_s"]) < 0.01


def test_seedless_replay_check_passes_with_server_gone(seedless_run: Any) -> None:
    """`kf replay --check` recomputes every decision (init selections included) offline."""
    db, _, _, _ = seedless_run
    assert replay_check(db)["check"]["decisions_checked"] >= 8
