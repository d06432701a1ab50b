"""Verdicts that know fp32 arithmetic: the float64 rule (kf.evaluation.wire.tolerance).

Real kernels on the CPU (C++ built with ``kf.native`` in kf's box, judged by a real
reference runner): honest mat-vec and matmul kernels that sum in another order than
eager fail plain allclose at 1e-4 and are accepted, because their error against a float64
run of the reference is within 2x eager fp32's own; a kernel that drops a term, one that
silently computes in fp16 and one with a wrong index are rejected. ``--tolerance
kernelbench`` keeps KernelBench's plain allclose. The long mat-vec is KernelBench's own
level-1 task 4 (from ``../shared/kernelbench`` or ``shared/kernelbench``) at the size of its
first release (M = 256, K = 131072) with its inputs from ``torch.randn`` as that release
drew them: outputs of mean 0, where atol = 1e-4 is all the tolerance near 0 and eager's
own error against float64 is about 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kf.evaluation import RunnerPool, TrialEvidence, VerifyReport, verify_candidate
from kf.evaluation.runner.compare import compare_outputs, judge_float64
from kf.evaluation.runner.float64 import check_with_float64, reference_in_float64
from kf.evaluation.wire.tolerance import Tolerance
from kf.kernels.tasks import Task, load_task

FIXTURES = Path(__file__).parent / "fixtures" / "numerics"
ROOT = Path(__file__).resolve().parent.parent
#: KernelBench's task files, beside the checkout (``../shared``) or in it (``shared/``)
MATVEC = next(
    (
        where / "kernelbench" / "level1" / "4_Matrix_vector_multiplication_.py"
        for where in (ROOT.parent / "shared", ROOT / "shared")
        if (where / "kernelbench").is_dir()
    ),
    ROOT.parent / "shared" / "kernelbench" / "level1" / "4_Matrix_vector_multiplication_.py",
)


def matvec_v0() -> Task:
    """KernelBench level 1 task 4 at its first release's size and inputs (module doc)."""
    if not MATVEC.exists():
        pytest.skip(f"KernelBench's task files are not at {MATVEC}")
    source = MATVEC.read_text()
    for old, new in (
        ("M = 256 * 8", "M = 256"),
        ("K = 131072 * 8", "K = 131072"),
        ("torch.rand(", "torch.randn("),
    ):
        assert old in source, f"{MATVEC.name} no longer has {old!r}"
        source = source.replace(old, new)
    return Task.from_source("4_Matrix_vector_multiplication_v0", source)


def _candidate(name: str) -> str:
    """Fixture ``matvec_<kernel>`` or ``matmul_<kernel>``: its file (matvec.py, matmul.py)
    with KERNEL set to that kernel."""
    file, kernel = name.split("_", 1)
    source = (FIXTURES / f"{file}.py").read_text()
    assert 'KERNEL = "double"' in source and f'"{kernel}":' in source, name
    return source.replace('KERNEL = "double"', f'KERNEL = "{kernel}"', 1)


def _every(report: VerifyReport) -> list[TrialEvidence]:
    return [*report.evidence, *report.variant_evidence, *report.distribution_evidence]


def _assert_passed_by_float64(report: VerifyReport) -> None:
    """Correct, and at least one comparison failed allclose and passed the float64 rule,
    with both errors in its evidence."""
    assert report.correct, report.error
    assert report.float64_passed >= 1, [e.reason for e in _every(report)]
    assert "float64" in report.rule
    decided = [e for e in _every(report) if e.rule == "float64"]
    assert decided, report.evidence
    for e in decided:
        assert e.rmse_fp64 is not None and e.eager_rmse_fp64 is not None
        assert e.rmse_fp64 <= 2 * e.eager_rmse_fp64 + 1e-5
        assert e.reason is not None and "elements outside atol=rtol=0.0001" in e.reason


def _assert_rejected_by_float64(report: VerifyReport) -> None:
    assert not report.correct
    assert report.failure_kind == "mismatch", report.error
    assert report.error is not None and "against a float64 run of the reference" in report.error
    last = report.evidence[-1]
    assert last.rule == "float64" and last.rmse_fp64 is not None
    assert last.eager_rmse_fp64 is not None and last.rmse_fp64 > 2 * last.eager_rmse_fp64


@pytest.mark.parametrize("name", ["matvec_double", "matvec_blocked"])
def test_long_matvec_summed_in_another_order_is_accepted(pool: RunnerPool, name: str) -> None:
    """Double accumulation (the most accurate there is) and eight fp32 partial sums both
    fail allclose at 1e-4 against eager and pass the float64 rule, the gate's shapes and
    the hidden distributions included."""
    _assert_passed_by_float64(verify_candidate(matvec_v0(), _candidate(name), pool=pool))


@pytest.mark.parametrize("name", ["matvec_dropped_term", "matvec_fp16"])
def test_matvec_bugs_are_rejected(pool: RunnerPool, name: str) -> None:
    """A sum without its last term, and one of fp16 products, are far outside the budget."""
    report = verify_candidate(matvec_v0(), _candidate(name), pool=pool, generalise=False)
    _assert_rejected_by_float64(report)


def test_kernelbench_tolerance_keeps_plain_allclose(pool: RunnerPool) -> None:
    """``--tolerance kernelbench``: the same honest kernel is judged by allclose alone."""
    report = verify_candidate(
        matvec_v0(),
        _candidate("matvec_double"),
        pool=pool,
        generalise=False,
        tolerance=Tolerance(preset="kernelbench"),
    )
    assert not report.correct and report.failure_kind == "mismatch"
    assert report.rule == "allclose" and report.float64_passed == 0
    last = report.evidence[-1]
    assert last.rule == "allclose" and last.rmse_fp64 is None
    assert "plain-allclose" in last.fp64_skipped


@pytest.mark.parametrize("name", ["matmul_pairwise", "matmul_double"])
def test_long_matmul_summed_in_another_order_is_accepted(pool: RunnerPool, name: str) -> None:
    task = load_task(FIXTURES / "task_matmul_long.py")
    _assert_passed_by_float64(verify_candidate(task, _candidate(name), pool=pool))


def test_matmul_wrong_index_is_rejected(pool: RunnerPool) -> None:
    task = load_task(FIXTURES / "task_matmul_long.py")
    report = verify_candidate(task, _candidate("matmul_wrong_index"), pool=pool, generalise=False)
    _assert_rejected_by_float64(report)


# -- the rule itself, on tensors ----------------------------------------------------


def test_one_wrong_element_among_millions_is_not_averaged_away() -> None:
    """rmse alone (torch's ``same``) would pass one element off by 0.005 among 1 M: its
    share of the rmse is 5e-6, under the floor; the largest-error bound rejects it."""
    torch.manual_seed(0)
    exact = torch.randn(1 << 20, dtype=torch.float64)
    eager = exact.float()
    wrong = eager.clone()
    wrong[123_456] += 0.005
    assert not compare_outputs(torch, [eager], [wrong])["ok"]
    verdict = judge_float64(torch, [eager], [wrong], [exact], None)
    assert not verdict["ok"] and verdict["kind"] == "mismatch"
    assert verdict["rmse_fp64"] <= 2 * verdict["eager_rmse_fp64"] + 1e-5  # rmse would pass
    assert "largest error" in verdict["reason"]


def test_non_finite_and_shape_rules_stand() -> None:
    """Output 0 fails allclose but passes the float64 rule (eager is 5e-4 off exact, the
    candidate 3e-4 off eager); a NaN in output 1 where the reference is finite stays
    ``nan_inf``, and a wrong shape ``shape_mismatch``."""
    torch.manual_seed(2)
    eager = torch.linspace(-1, 1, 64)
    exact = eager.double() + 5e-4 * torch.randn(64, dtype=torch.float64)
    near = eager + 3e-4
    assert judge_float64(torch, [eager], [near], [exact], None)["ok"]
    bad = near.clone()
    bad[5] = float("nan")
    verdict = judge_float64(torch, [eager, eager], [near, bad], [exact, exact], None)
    assert not verdict["ok"] and verdict["kind"] == "nan_inf"
    assert "output 1" in verdict["reason"]
    verdict = judge_float64(torch, [eager, eager], [near, near[:10]], [exact, exact], None)
    assert not verdict["ok"] and verdict["kind"] == "shape_mismatch"


class _CastsItself(torch.nn.Module):
    """A forward that casts to float32 whatever it is given: no float64 run is possible."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * 3).cumsum(0)


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 4096))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def test_float64_run_says_why_not() -> None:
    """A task whose forward casts to float32 gets allclose's verdict and the reason."""
    x = torch.randn(1000)
    model = _CastsItself()
    expected = [model(x)]
    assert isinstance(reference_in_float64(torch, model, [x], expected), str)
    got = [expected[0] + 1e-3]
    failed = compare_outputs(torch, expected, got)
    verdict = check_with_float64(torch, model, [x], expected, got, None, failed)
    assert not verdict["ok"] and "forward casts" in verdict["fp64_skipped"]


def test_float64_run_of_a_model_with_parameters() -> None:
    """The Model's parameters are cast too (in a copy): the reference stays fp32, and the
    float64 run's outputs are float64 and closer to exact than eager's."""
    torch.manual_seed(1)
    model = _Linear()
    x = torch.randn(16, 4096)
    expected = [model(x).detach()]
    exact = reference_in_float64(torch, model, [x], expected)
    assert not isinstance(exact, str)
    assert exact[0].dtype == torch.float64 and model.weight.dtype == torch.float32
    truth = x.double() @ model.weight.detach().double().t()
    assert torch.equal(exact[0], truth)


def test_approximate_transcendental_beyond_the_budget_is_rejected() -> None:
    """GELU by its tanh approximation in place of erf: up to about 5e-4 off, against eager
    fp32's 1e-8 or so from float64: rejected; the same error budget would have let it
    through only were eager as inaccurate."""
    torch.manual_seed(3)
    x = torch.randn(4096, 256)
    eager = torch.nn.functional.gelu(x)
    exact = torch.nn.functional.gelu(x.double())
    approx = torch.nn.functional.gelu(x, approximate="tanh")
    assert not compare_outputs(torch, [eager], [approx])["ok"]
    verdict = judge_float64(torch, [eager], [approx], [exact], None)
    assert not verdict["ok"] and verdict["kind"] == "mismatch"
    assert verdict["rmse_fp64"] > 2 * verdict["eager_rmse_fp64"] + 1e-5
