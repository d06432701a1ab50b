"""How a runner applies the baselines' settings the grader sends it: the TF32 setting it
computes under (:func:`apply_tf32`, before any task or candidate code runs) and the
``torch.compile`` arguments of the compiled reference (:func:`compile_kwargs`). What the
settings mean, and where they come from: :mod:`kf.evaluation.grader.baseline_settings`.
"""

from __future__ import annotations

from typing import Any

from kf.evaluation.wire.protocol import COMPILE_MODES, TF32_SETTINGS, BaselineSettingError

__all__ = ["apply_tf32", "compile_kwargs", "describe_compile", "read_tf32"]


def compile_kwargs(mode: str) -> dict[str, Any]:
    """``torch.compile``'s keyword arguments for a baseline in ``mode`` (inductor, static
    shapes; ``mode`` left out for the default, as a plain ``torch.compile`` call does)."""
    if mode not in COMPILE_MODES:
        raise BaselineSettingError(f"compile mode {mode!r}: expected one of {COMPILE_MODES}")
    kw: dict[str, Any] = {"backend": "inductor", "dynamic": False}
    if mode != "default":
        kw["mode"] = mode
    return kw


def describe_compile(mode: str, torch_version: str) -> str:
    """How the compiled reference was made, for ``ProfileReport.compile_baseline``."""
    return f"torch.compile(mode {mode}, backend inductor, dynamic=False), torch {torch_version}"


def read_tf32(torch: Any) -> dict[str, Any]:
    """The TF32 settings this process computes under, as torch reports them."""
    return {
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": str(torch.get_float32_matmul_precision()),
    }


def apply_tf32(torch: Any, setting: str | None) -> dict[str, Any]:
    """Set TF32 ``on`` or ``off`` in this process (a runner, before any task or candidate
    code runs) and return the settings read back, with ``tf32``: the setting, or
    ``"pytorch-default"`` when ``setting`` is None (nothing changed)."""
    if setting is not None:
        if setting not in TF32_SETTINGS:
            raise BaselineSettingError(f"tf32 {setting!r}: expected off or on")
        on = setting == "on"
        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on
        torch.set_float32_matmul_precision("high" if on else "highest")
    return {"tf32": setting or "pytorch-default", **read_tf32(torch)}
