"""How the baselines are run: the ``torch.compile`` mode of the compiled reference, and the
TF32 setting every runner (the reference's above all) computes under.

The grader reads both from its environment and sends them to its runners; the runners
apply them (:mod:`kf.evaluation.runner.baselines`) and say back what they did,
and the profile records what the runners said (``ProfileReport.compile_mode``,
``ProfileReport.tf32``), never merely what was asked.

- ``$KF_COMPILE_MODE`` (``kf run --compile-mode``): ``default`` (inductor's default mode,
  what ``torch.compile(model)`` gives and KernelBench's ``torch_compile_inductor_default``
  baseline), or ``max-autotune``, ``max-autotune-no-cudagraphs``, ``reduce-overhead``.
  Compiling, and max-autotune's autotuning, happen in the first call, which is not timed;
  the warm-up calls after it (CUDA graph recording for the cudagraph modes) are not
  timed either.
- ``$KF_TF32`` (``kf run --tf32``): ``off`` (the default: fp32 matmuls and convolutions in
  full fp32, ``torch.backends.cuda.matmul.allow_tf32 = False``,
  ``torch.backends.cudnn.allow_tf32 = False``, ``float32_matmul_precision = "highest"``)
  or ``on`` (TF32 for both, precision ``"high"``). PyTorch's own default is mixed — matmul
  off, cuDNN convolutions on — so kf sets both explicitly, the same in the reference's
  runner and the candidate's.
"""

from __future__ import annotations

from typing import Any

from kf.evaluation.wire.protocol import COMPILE_MODES, TF32_SETTINGS, BaselineSettingError
from kf.settings import current

__all__ = [
    "COMPILE_MODES",
    "TF32_SETTINGS",
    "BaselineSettingError",
    "compile_mode",
    "tf32_setting",
    "tf32_summary",
]


def compile_mode() -> str:
    """``$KF_COMPILE_MODE`` (default ``default``); raises :class:`BaselineSettingError`."""
    mode = current().compile_mode
    if mode not in COMPILE_MODES:
        raise BaselineSettingError(
            f"KF_COMPILE_MODE={mode!r}: not a torch.compile mode kf knows "
            f"({', '.join(COMPILE_MODES)})"
        )
    return mode


def tf32_setting() -> str:
    """``$KF_TF32`` (default ``off``); raises :class:`BaselineSettingError`."""
    value = current().tf32
    if value not in TF32_SETTINGS:
        raise BaselineSettingError(f"KF_TF32={value!r}: expected off or on")
    return value


def tf32_summary(precision: dict[str, Any] | None) -> str:
    """One word for a report: ``off``, ``on``, or ``pytorch-default`` (what PyTorch starts
    with: matmul off, cuDNN on), ``""`` when a runner did not say."""
    if not precision:
        return ""
    return str(precision.get("tf32") or "")
