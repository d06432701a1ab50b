"""The adversarial suite: every cheating candidate is rejected or flagged; honest ones pass.

Each candidate is a file in ``tests/fixtures/adversarial``; each is evaluated once, as
``kf eval`` does (compile, verify with the generalisation gate, profile), through the
Python API with a shared pool of warm runners and a short profile.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kf.evaluation import (
    EvalResult,
    Limits,
    ProfileReport,
    RunnerPool,
    compile_candidate,
    evaluate,
    verify_candidate,
)
from kf.evaluation.grader.cli import _human
from kf.evaluation.grader.cli import main as eval_main
from kf.evaluation.grader.verifying import reverify_fast
from tests.runner_cases import (
    FLAGGED,
    HONEST,
    PROFILED,
    QUICK,
    REJECTED,
    TASK_FILE,
    gelu_task,
)

FIXTURES = Path(__file__).parent / "fixtures" / "adversarial"
TASK = gelu_task()
#: the tiny task with its own unseen shapes: get_extra_inputs() for the gate
EXTRA_TASK = gelu_task(
    more="""

def get_extra_inputs() -> list[list[torch.Tensor]]:
    return [[torch.randn(7, 1024)], [torch.randn(130, 1024)]]
""",
    name="task_gelu_extra",
)


def source(name: str) -> str:
    return (FIXTURES / f"{name}.py").read_text()


@pytest.fixture(scope="module")
def results(pool: RunnerPool) -> dict[str, EvalResult]:
    """Evaluations done so far, by candidate name (each candidate is evaluated once)."""
    return {}


def evaluated(name: str, pool: RunnerPool, results: dict[str, EvalResult]) -> EvalResult:
    if name not in results:
        results[name] = evaluate(
            TASK,
            source(name),
            pool=pool,
            timeout_s=90,
            profile_options=QUICK,
            profile=name in PROFILED,
        )
    return results[name]


@pytest.mark.parametrize("name", HONEST)
def test_adversarial_honest_candidate_passes_unflagged(
    name: str, pool: RunnerPool, results: dict[str, EvalResult]
) -> None:
    """An honest C++ kernel passes every stage and the gate, with no flag and no warning."""
    result = evaluated(name, pool, results)
    assert result.passed, result.error
    assert result.flags == ()
    assert result.verify is not None
    assert len(result.verify.variant_evidence) == 2
    assert all(e.ok and "leading dimension" in e.label for e in result.verify.variant_evidence)
    assert result.profile is not None and result.profile.fresh_runtime_ms is not None


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_adversarial_cheat_is_rejected_with_reason(
    name: str, pool: RunnerPool, results: dict[str, EvalResult]
) -> None:
    """Each rejected cheat fails with the expected failure kind and a reason that names it."""
    kinds, reason = REJECTED[name]
    result = evaluated(name, pool, results)
    assert not result.passed
    assert result.failure_kind in kinds.split("|"), result.error
    assert reason in (result.error or ""), result.error
    assert "REJECTED" in _human(result) or "FAILED" in _human(result)


@pytest.mark.parametrize("name", sorted(FLAGGED))
def test_adversarial_cheat_is_flagged_with_reason(
    name: str, pool: RunnerPool, results: dict[str, EvalResult]
) -> None:
    """Each flagged cheat carries the expected flag, shown with its reason by ``kf eval``."""
    code = FLAGGED[name]
    result = evaluated(name, pool, results)
    assert any(f.startswith(f"{code}:") for f in result.flags), result.flags
    text = _human(result)
    assert "flagged" in text or "SUSPECT" in text
    assert code in text


@pytest.mark.parametrize("name", ["cache_outputs", "grader_stack"])
def test_adversarial_timing_cheat_is_suspect(
    name: str, pool: RunnerPool, results: dict[str, EvalResult]
) -> None:
    """A candidate whose timing cannot be trusted is marked suspect (never an elite)."""
    assert evaluated(name, pool, results).suspect


def test_adversarial_gate_uses_task_extra_inputs(pool: RunnerPool) -> None:
    """A task's get_extra_inputs() drives the gate; a shape-specialised kernel fails it."""
    honest = verify_candidate(EXTRA_TASK, source("honest_cpp"), pool=pool)
    assert honest.correct, honest.error
    assert [e.label.split(":")[0] for e in honest.variant_evidence] == ["get_extra_inputs()"] * 2
    special = verify_candidate(EXTRA_TASK, source("shape_special"), pool=pool)
    assert special.failure_kind == "generalisation_failed"
    assert "[130, 1024]" in (special.error or "")


def test_adversarial_big_speedup_is_reverified(pool: RunnerPool) -> None:
    """A speed-up above 10× is re-verified: flagged when it holds, failed when it does not."""
    claimed = ProfileReport(ok=True, speedup=50.0, runtime_ms=0.01, ref_runtime_ms=0.5)
    held = reverify_fast(TASK, source("honest_cpp"), claimed, pool=pool)
    assert held.ok
    assert any(f.startswith("speedup_over_10x:") and "passed" in f for f in held.flags)
    assert held.reverify is not None and held.reverify.correct
    broke = reverify_fast(TASK, source("shape_special"), claimed, pool=pool)
    assert not broke.ok
    assert broke.failure_kind == "reverify_failed"


@pytest.mark.parametrize(
    ("name", "limits", "kind", "reason"),
    [
        ("memory_hog", Limits(), "exception", "ModelNew(*get_init_inputs()) raised"),
        ("file_hog", Limits(file_bytes=8 << 20), "exception", "File too large"),
        ("cpu_hog", Limits(cpu_s=1), "crash", "SIGXCPU"),
    ],
)
def test_adversarial_resource_limit_stops_candidate(
    pool: RunnerPool, name: str, limits: Limits, kind: str, reason: str
) -> None:
    """Memory, file-size and CPU-time limits stop a hostile candidate with a clear reason."""
    report = compile_candidate(TASK, source(name), pool=pool, limits=limits, timeout_s=60)
    assert not report.ok
    assert report.failure_kind == kind
    assert reason in (report.error or "") + report.log


def test_adversarial_cli_rejects_tampering(capsys: pytest.CaptureFixture[str]) -> None:
    """``kf eval`` on a runner-patching candidate exits 1 and says it was tampering."""
    status = eval_main([str(TASK_FILE), str(FIXTURES / "runner_patch.py")])
    out, err = capsys.readouterr()
    assert status == 1
    assert "tampering" in out
    assert "altered the runner" in err


def test_pairing_times_two_real_candidates_and_refuses_a_wrong_one(pool: RunnerPool) -> None:
    """The paired re-timing (a challenger within noise of the incumbent) loads both in
    fresh boxed runners of one session and times them in alternating rounds: each side
    gets its samples; a side whose output is wrong on the checked inputs gives no
    pairing at all (the caller keeps its own measurement)."""
    from kf.evaluation.grader.pairing import paired_times

    times = paired_times(TASK, source("honest_cpp"), source("honest_rows"), pool=pool, **QUICK)
    assert times is not None
    mine, theirs = times
    assert len(mine) >= QUICK["min_trials"] and len(theirs) >= QUICK["min_trials"]
    assert all(t > 0 for t in mine + theirs)
    wrong, honest = source("nan_output"), source("honest_cpp")
    assert paired_times(TASK, wrong, honest, pool=pool, **QUICK) is None
    assert paired_times(TASK, honest, wrong, pool=pool, **QUICK) is None
