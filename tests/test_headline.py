"""The headline follows the audit: fast_p and the geomeans leave out the tasks kf's audit
marked degenerate (a constant passes them), which are scored on their own line, as
KernelBench-Verified leaves out level 2's tasks 23, 80 and 83. The whole run (``kf
run`` on a degenerate task, its report, table and dashboard) is checked in
``tests/test_trust.py::test_run_marks_a_degenerate_task_and_flags_its_speedups``."""

from __future__ import annotations

import pytest

from kf.app.kernelbench import format_levels, level_scores
from kf.app.report import headline


def test_headline_leaves_out_degenerate_tasks() -> None:
    """Level 2 as observed on the H200: two constant-output kernels (320x, 17.5x) on
    degenerate tasks made the geomean 7.64x; without them it is the honest tasks'."""
    speedups = {"a": 2.0, "b": 0.5, "23_degenerate": 320.0, "80_degenerate": 17.5}
    n = 5  # one task without a correct kernel
    out = headline(speedups, dict(speedups), n, {"23_degenerate", "80_degenerate"})
    assert out["headline_tasks"] == 3
    assert out["fast_p"]["fast_1"] == pytest.approx(1 / 3)
    assert out["geomean_speedup"] == pytest.approx(1.0)
    assert out["degenerate"]["tasks"] == ["23_degenerate", "80_degenerate"]
    assert out["degenerate"]["fast_p"]["fast_2"] == 1.0
    assert out["degenerate"]["geomean_speedup"] == pytest.approx((320 * 17.5) ** 0.5)
    assert "KernelBench-Verified" in out["headline_note"]
    plain = headline(speedups, dict(speedups), n, set())
    assert "degenerate" not in plain and plain["geomean_speedup"] > 4


def _row(name: str, speedup: float | None, *, degenerate: bool = False) -> dict[str, object]:
    return {
        "problem_name": name,
        "compiled": speedup is not None,
        "correctness": speedup is not None,
        "speedup": speedup,
        "speedup_vs_compile": speedup,
        "speedup_vs_best": speedup,
        "degenerate": degenerate,
    }


def test_level_scores_leave_out_degenerate_rows() -> None:
    rows = [
        _row("1_Conv.py", 1.5),
        _row("2_Gemm.py", None),
        _row("23_Conv3d_GroupNorm_Mean.py", 320.0, degenerate=True),
    ]
    s = level_scores(rows)
    assert s["tasks"] == 2 and s["correct"] == 1
    assert s["fast_p"]["eager"]["fast_1"] == 0.5
    assert s["geomean_speedup"]["eager"] == pytest.approx(1.5)
    assert s["degenerate"]["problems"] == ["23_Conv3d_GroupNorm_Mean.py"]
    assert s["degenerate"]["geomean_speedup"]["eager"] == pytest.approx(320.0)
    text = "\n".join(format_levels({"levels": {"level2": s}}))
    assert "left out of the scores above: 23_Conv3d_GroupNorm_Mean.py" in text
    assert "geomean over correct 1.50×" in text
