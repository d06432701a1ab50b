"""The baselines' settings: the torch.compile mode (max-autotune as an option) and TF32 set
explicitly in every runner, recorded in each profile as the reference runner stated them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kf.evaluation.grader import baseline_settings as bs
from kf.evaluation.runner import baselines

ROOT = Path(__file__).resolve().parent.parent
EVAL = ROOT / "tests" / "fixtures" / "eval"
FAST: dict[str, Any] = {"min_time_s": 0.05, "min_trials": 5, "warmup": 2}


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KF_COMPILE_MODE", raising=False)
    monkeypatch.delenv("KF_TF32", raising=False)
    assert bs.compile_mode() == "default" and bs.tf32_setting() == "off"
    monkeypatch.setenv("KF_COMPILE_MODE", "max-autotune")
    monkeypatch.setenv("KF_TF32", "ON")
    assert bs.compile_mode() == "max-autotune" and bs.tf32_setting() == "on"
    assert baselines.compile_kwargs("max-autotune") == {
        "backend": "inductor",
        "dynamic": False,
        "mode": "max-autotune",
    }
    assert "mode" not in baselines.compile_kwargs("default")  # as plain torch.compile(model)
    monkeypatch.setenv("KF_COMPILE_MODE", "fastest")
    with pytest.raises(bs.BaselineSettingError, match="KF_COMPILE_MODE='fastest'"):
        bs.compile_mode()
    monkeypatch.setenv("KF_TF32", "maybe")
    with pytest.raises(bs.BaselineSettingError, match="expected off or on"):
        bs.tf32_setting()


def test_tf32_is_set_explicitly_and_read_back() -> None:
    """PyTorch starts mixed (matmul off, cuDNN on); ``off`` turns both off, ``on`` both on."""
    before = baselines.read_tf32(torch)
    try:
        assert baselines.apply_tf32(torch, "off") == {
            "tf32": "off",
            "matmul_allow_tf32": False,
            "cudnn_allow_tf32": False,
            "float32_matmul_precision": "highest",
        }
        on = baselines.apply_tf32(torch, "on")
        assert on["matmul_allow_tf32"] and on["cudnn_allow_tf32"]
        assert on["float32_matmul_precision"] == "high"
        assert baselines.apply_tf32(torch, None)["tf32"] == "pytorch-default"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before["matmul_allow_tf32"]
        torch.backends.cudnn.allow_tf32 = before["cudnn_allow_tf32"]
        torch.set_float32_matmul_precision(before["float32_matmul_precision"])


def test_profile_records_the_settings_the_runners_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile under $KF_TF32=on and $KF_COMPILE_MODE=max-autotune records both as the
    reference runner stated them; the compiled baseline is described with its mode."""
    from kf.evaluation import RunnerPool, profile_candidate
    from kf.tasks import load_task

    monkeypatch.setenv("KF_COMPILE_BASELINE", "1")
    monkeypatch.setenv("KF_TF32", "on")
    monkeypatch.setenv("KF_COMPILE_MODE", "max-autotune")
    pool = RunnerPool(size=1)
    try:
        task = load_task(EVAL / "task_gelu.py")
        report = profile_candidate(task, (EVAL / "honest.py").read_text(), pool=pool, **FAST)
        assert report.ok, report.error
        assert report.tf32 == "on"
        assert report.compile_baseline_error is None, report.compile_baseline_error
        assert report.compile_mode == "max-autotune"
        assert "mode max-autotune" in report.compile_baseline
        monkeypatch.setenv("KF_COMPILE_BASELINE", "0")
        monkeypatch.setenv("KF_TF32", "off")
        off = profile_candidate(task, (EVAL / "honest.py").read_text(), pool=pool, **FAST)
        assert off.ok and off.tf32 == "off" and off.compile_mode == ""
    finally:
        pool.close()
