"""Trust without false alarms (issue 17): timing checks at microsecond scale, the gate's
shapes, tolerances, hidden input distributions, degenerate tasks and build limits."""

from __future__ import annotations

import json
import shutil
import threading
import types
from pathlib import Path

import pytest
import torch

from kf import buildlimits
from kf.evaluation import RunnerPool, compile_candidate, verify_candidate
from kf.evaluation.grader.audit import audit_task
from kf.evaluation.grader.timing_checks import cache_suspected, timer_disagreement
from kf.evaluation.runner.compare import compare_outputs
from kf.evaluation.runner.variants import derived_shapes
from kf.evaluation.wire.tolerance import Tolerance, declared, resolve
from kf.kernels.tasks import load_task
from tests.harness import run_kf
from tests.runner_cases import gelu_task

FIXTURES = Path(__file__).parent / "fixtures"
TRUST = FIXTURES / "trust"
GELU = gelu_task()


def source(name: str) -> str:
    return (TRUST / f"{name}.py").read_text()


# -- timing checks (pure) -----------------------------------------------------------


def test_timer_disagreement_subtracts_the_empty_call() -> None:
    """An honest 5 µs kernel whose wall clock shows 90 µs a call, 85 µs of which an empty
    call costs too, is not flagged; without that subtraction it would be (the old false
    alarm); the side-stream cheat (0.12 ms claimed, 0.94 ms seen) still is."""
    honest = [(200, 200 * 0.090, 200 * 0.005)] * 6
    assert timer_disagreement(honest, empty_ms=0.085) is None
    assert timer_disagreement(honest, empty_ms=0.0) is not None
    cheat = [(50, 50 * 0.94, 50 * 0.12)] * 6
    found = timer_disagreement(cheat, empty_ms=0.09)
    assert found is not None and "0.1200 ms" in found


def test_timer_disagreement_decided_by_the_median_batch() -> None:
    """One batch slowed by the machine does not flag a kernel; most batches disagreeing does."""
    ok = (100, 100 * 0.2, 100 * 0.19)
    slow = (100, 100 * 5.0, 100 * 0.19)
    assert timer_disagreement([ok, ok, slow, ok, ok], empty_ms=0.001) is None
    assert timer_disagreement([slow, slow, ok, slow, ok], empty_ms=0.001) is not None


def test_cache_suspected_paired_at_microsecond_scale() -> None:
    """Fresh calls a little slower than the paired repeated ones (new memory) are honest; a
    cache that answers repeated inputs for nothing is caught."""
    assert cache_suspected([0.012, 0.011, 0.013], [0.006, 0.006, 0.007], empty_ms=0.003) is None
    assert cache_suspected([0.300, 0.310, 0.305], [0.004, 0.004, 0.005], empty_ms=0.001)


# -- tolerance ---------------------------------------------------------------------


def test_tolerance_resolution_order() -> None:
    """--atol/--rtol beat the task's KF_ATOL/KF_RTOL, which beat a run's preset; only number
    literals count in a task file."""
    task = "KF_ATOL = 1e-3\nKF_RTOL = 2e-3\nKF_TOLERANCE = 'kernelbench-verified'\n"
    assert declared(task) == Tolerance(atol=1e-3, rtol=2e-3, preset="kernelbench-verified")
    assert declared("KF_ATOL = compute()\nKF_RTOL = -1\n") == Tolerance()
    chosen, where = resolve(Tolerance(atol=5e-4), task)
    assert (chosen.atol, chosen.rtol) == (5e-4, 2e-3)
    assert "--atol" in where and "KF_ATOL" in where
    chosen, where = resolve(Tolerance(preset="kernelbench-verified"), "")
    assert chosen.preset == "kernelbench-verified" and "preset" in where
    assert resolve(None, "")[1] == "KernelBench's default"


def test_compare_reports_the_smallest_passing_tolerance() -> None:
    """A 131,072-long dot product's one element off by 5.9e-4 fails atol=rtol=1e-4, says
    the max abs and rel error and the tolerance that would pass, and passes the
    KernelBench-Verified preset (1e-3 for fp32)."""
    want = torch.full((131072,), 0.5)
    got = want.clone()
    got[7] += 5.9e-4 * 1.5
    verdict = compare_outputs(torch, [want], [got])
    assert not verdict["ok"]
    assert (
        "atol=rtol=0.0001" in verdict["reason"]
        and "would pass at atol=rtol=0.00059" in (verdict["reason"])
    )
    assert verdict["min_tol"] == pytest.approx(5.9e-4, rel=1e-3)
    assert compare_outputs(torch, [want], [got], {"preset": "kernelbench-verified"})["ok"]


# -- the gate's shapes (pure) ------------------------------------------------------


def test_gate_scales_the_tasks_size_constants() -> None:
    """For a square A @ B task (N × N by N × N) the gate rescales N, so both operands
    stay square; it never rescales A's rows alone."""
    module = types.ModuleType("task_square")
    module.N = 64  # type: ignore[attr-defined]
    module.get_inputs = lambda: [torch.randn(module.N, module.N), torch.randn(module.N, module.N)]  # type: ignore[attr-defined]

    def get_inputs(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return list(module.get_inputs())  # type: ignore[attr-defined]

    for variant, size in ((0, 33), (1, 97)):
        options = list(derived_shapes(torch, module, get_inputs, 1, variant))
        assert [tuple(t.shape) for t in options[0][1]] == [(size, size), (size, size)]
        assert all("first input" not in label for label, _ in options)
    assert module.N == 64  # type: ignore[attr-defined]


# -- with real runners ---------------------------------------------------------------


def test_square_task_honest_kernel_passes_the_gate(pool: RunnerPool) -> None:
    """An honest kernel written for the task's own N × N contract is not falsely rejected."""
    report = verify_candidate(
        load_task(TRUST / "task_square.py"), source("honest_square"), pool=pool
    )
    assert report.correct, report.error
    labels = [e.label for e in report.variant_evidence]
    assert [label.split(":")[0] for label in labels] == [
        "task size constants N=64→33",
        "task size constants N=64→97",
    ]
    assert "[[33, 33], [33, 33]]" in labels[0]


def test_kernel_correct_only_on_positive_inputs_is_rejected(pool: RunnerPool) -> None:
    """A kernel right on the task's [0, 1) inputs but wrong on them negated fails the hidden
    input distributions, though it passes every trial and the gate."""
    report = verify_candidate(
        load_task(TRUST / "task_relu_pos.py"), source("positive_only"), pool=pool
    )
    assert not report.correct
    assert report.failure_kind == "distribution_failed"
    assert "inputs ×-1" in (report.error or "")
    assert [e.ok for e in report.variant_evidence] == [True, True]
    assert [e.label for e in report.distribution_evidence][:2] == ["inputs ×3", "inputs ×0.01"]


def test_tolerance_per_run_and_per_task(pool: RunnerPool) -> None:
    """A kernel off by 3e-4 fails the default with the tolerance that would pass named,
    and passes with the kernelbench-verified preset and with a task's own KF_ATOL."""
    strict = verify_candidate(GELU, source("off_by_3e4"), pool=pool, generalise=False)
    assert strict.failure_kind == "mismatch"
    assert "would pass at atol=rtol=0.0003" in (strict.error or "")
    loose = verify_candidate(
        GELU, source("off_by_3e4"), pool=pool, tolerance=Tolerance(preset="kernelbench-verified")
    )
    assert loose.correct, loose.error
    assert loose.atol == pytest.approx(1e-3) and loose.min_tolerance == pytest.approx(3e-4, rel=0.1)
    declares = gelu_task(more="\nKF_ATOL = 1e-3\nKF_RTOL = 1e-3\n", name="task_gelu_tol")
    own = verify_candidate(declares, source("off_by_3e4"), pool=pool)
    assert own.correct, own.error
    assert own.tolerance_source == "the task's KF_ATOL/KF_RTOL"


def test_audit_marks_only_the_degenerate_task(pool: RunnerPool) -> None:
    """A task whose outputs do not depend on its inputs is degenerate; gelu(x + b) is not."""
    audit = audit_task(load_task(TRUST / "task_degenerate.py"), pool=pool)
    assert audit.degenerate, audit
    assert "all zeros pass" in audit.reason
    assert not audit_task(GELU, pool=pool).degenerate


def test_build_waiting_for_a_core_is_not_timed(
    pool: RunnerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every build slot taken, a build queues; the wait does not count against its
    limit, so a build held up for longer than its limit still succeeds."""
    monkeypatch.setenv("KF_BUILD_JOBS", "1")
    done: list[object] = []
    with buildlimits.build_slot():  # another build holds the only core
        worker = threading.Thread(
            target=lambda: done.append(
                compile_candidate(
                    GELU,
                    (FIXTURES / "adversarial" / "honest_cpp.py").read_text(),
                    pool=pool,
                    timeout_s=3.0,
                )
            )
        )
        worker.start()
        for _ in range(500):
            if buildlimits.waiting() == 1:
                break
            threading.Event().wait(0.01)
        assert buildlimits.waiting() == 1
        threading.Event().wait(4.0)  # the other build keeps the core past the limit
    worker.join(120)
    report = done[0]
    assert getattr(report, "ok", False), report
    assert report.phases["build_queue"] >= 4.0  # type: ignore[attr-defined]


def test_run_marks_a_degenerate_task_and_flags_its_speedups(tmp_path: Path) -> None:
    """``kf run`` on a degenerate task records one audit, reports the task as degenerate
    with its best speed-up flagged, and the log still replays."""
    folder = tmp_path / "tasks"
    (folder / "seeds").mkdir(parents=True)
    shutil.copy(TRUST / "task_degenerate.py", folder / "degen.py")
    shutil.copy(TRUST / "constant_zeros.py", folder / "seeds" / "degen.py")
    db = tmp_path / "run.db"
    done = run_kf(
        "run", str(folder / "degen.py"), "--budget", "1", "--db", str(db), "--json",
        "--unsafe-no-sandbox", timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["degenerate_tasks"] == ["degen"]
    (task,) = report["tasks"]
    assert task["degenerate"] and task["audit"]["degenerate"]
    assert any(f.startswith("degenerate_task:") for f in task["best_flags"])
    # the headline leaves it out (tests/test_headline.py) and scores it on its own line
    assert report["headline_tasks"] == 0 and not report["geomean_speedup"]
    assert report["fast_p"]["fast_0"] == 0.0
    assert report["degenerate"]["tasks"] == ["degen"]
    assert report["degenerate"]["fast_p"]["fast_0"] == 1.0
    (row,) = report["kernelbench"]["rows"]
    assert row["degenerate"] and row["correctness"]
    table = run_kf("report", str(db))
    assert "DEGENERATE task" in table.stdout
    assert "degenerate, left out: degen" in table.stdout
    from kf.app.dashboard import report_html

    assert '"degenerate_tasks":["degen"]' in report_html(db)
    replay = run_kf("replay", str(db), "--check")
    assert replay.returncode == 0, replay.stdout + replay.stderr
