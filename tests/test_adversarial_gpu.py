"""GPU variants of the adversarial suite; they need an NVIDIA GPU and a CUDA build of PyTorch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kf.evaluation import evaluate
from kf.kernels.static_checks import check_source
from tests.runner_cases import gelu_task

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: side-stream timing cheats only exist on a GPU",
    ),
]

FIXTURES = Path(__file__).parent / "fixtures" / "adversarial"
#: the tiny task at 4096 x 8192: big enough that work hidden on a side stream shows
BIG = (4096, 8192)


def test_adversarial_gpu_side_stream_is_flagged_and_timed() -> None:
    """Work on a side stream is caught by device-wide sync (correct output) and flagged."""
    source = (FIXTURES / "side_stream.py").read_text()
    assert any(w.startswith("stream:") for w in check_source(source))
    result = evaluate(
        gelu_task(),
        source,
        device="cuda:0",
        profile_options={"min_time_s": 0.05, "warmup": 2, "min_trials": 10},
    )
    assert any(f.startswith("stream:") for f in result.flags)
    assert result.profile is None or result.profile.speedup < 10 or not result.profile.ok


def test_adversarial_gpu_microsecond_kernel_not_suspect_side_stream_still_caught() -> None:
    """An honest Triton kernel of a few µs a call (64 × 1024) is not suspect, although the
    grader's wall clock sees the launch, synchronisation and L2 flush of every sample; the
    side-stream cheat on a task big enough to matter is flagged (``stream``) and either
    suspect (timer_disagreement) or timed as it really runs: its stated time is not under
    two thirds of the grader's wall clock a call over a batch (the cross-check's ratio).
    Which of the two depends on the run (on the H200 in 2026-12-01's trust table it was
    suspect; in 2026-12-02's test run its two clocks agreed: 0.17 ms a call)."""
    quick = {"min_time_s": 0.05, "warmup": 2, "min_trials": 10}
    honest = evaluate(
        gelu_task(),
        (FIXTURES.parent / "honest" / "triton_wrapper.py").read_text(),
        device="cuda:0",
        profile_options=quick,
    )
    assert honest.passed, honest.error
    assert honest.profile is not None
    assert not honest.suspect, (
        honest.profile.runtime_ms,
        honest.profile.empty_call_ms,
        honest.flags,
    )
    cheat = evaluate(
        gelu_task(*BIG, name="task_gelu_big"),
        (FIXTURES / "side_stream.py").read_text(),
        device="cuda:0",
        profile_options=quick,
    )
    assert any(f.startswith("stream:") for f in cheat.flags), cheat.flags
    if _rejected_for_its_output(cheat):
        return
    profile = cheat.profile
    assert profile is not None and profile.ok, cheat.error
    if not cheat.suspect:  # then the side stream's work was in its stated time
        assert profile.runtime_ms * 1.5 >= profile.outside_wall_ms, (
            profile.runtime_ms,
            profile.outside_wall_ms,
        )


def test_adversarial_gpu_under_host_load_honest_not_suspect_side_stream_caught() -> None:
    """Under host load (twice as many spinning processes as cores, as several ``kf eval``
    and builds at once): the honest microsecond kernel is not suspect
    (kf.evaluation.grader.timing_checks re-measures a disagreement before flagging it), and the
    side-stream cheat is flagged ``stream`` and either suspect or timed as it really runs,
    as on a quiet host."""
    from tests.test_timing_load import busy

    quick = {"min_time_s": 0.05, "warmup": 2, "min_trials": 10}
    with busy(max(4, 2 * (os.cpu_count() or 1))):
        honest = evaluate(
            gelu_task(),
            (FIXTURES.parent / "honest" / "triton_wrapper.py").read_text(),
            device="cuda:0",
            profile_options=quick,
        )
        cheat = evaluate(
            gelu_task(*BIG, name="task_gelu_big"),
            (FIXTURES / "side_stream.py").read_text(),
            device="cuda:0",
            profile_options=quick,
        )
    assert honest.passed, honest.error
    assert honest.profile is not None
    assert not honest.suspect, (honest.profile.runtime_ms, honest.flags)
    assert any(f.startswith("stream:") for f in cheat.flags), cheat.flags
    if _rejected_for_its_output(cheat):
        return
    profile = cheat.profile
    assert profile is not None and profile.ok, cheat.error
    if not cheat.suspect:
        assert profile.runtime_ms * 1.5 >= profile.outside_wall_ms, (
            profile.runtime_ms,
            profile.outside_wall_ms,
        )


def _rejected_for_its_output(cheat: Any) -> bool:
    """Whether the side-stream cheat was caught before timing: its output, read before
    its unsynchronised stream finished, was wrong. Seen on the H200 on 2026-12-03 (every
    element wrong on the hidden inputs x0.01); earlier sessions saw it pass verification
    and be caught by timing. Either way it never gets a speed-up."""
    if cheat.passed:
        return False
    assert cheat.profile is None, cheat.profile
    assert "mismatch" in (cheat.error or ""), cheat.error
    return True
