"""The run's measuring conditions besides its tolerance (:class:`Conditions`): whether and
how the reference is also timed under ``torch.compile``, the TF32 setting every runner (the
reference's above all) computes under, and where a GPU runner makes the trial inputs.

They are part of the run's recorded config (``RunStarted.config``, keys
``compile_baseline``, ``compile_mode``, ``tf32``, ``device_inputs``), as the tolerance is:
``kf run`` makes them once from its flags and settings (:meth:`Conditions.from_settings`)
and records them; every grader (the local worker's, a ``kf worker``'s, a resumed run's)
reads them from the log's config (:meth:`Conditions.of`) and hands them down in its grading session
(:class:`kf.evaluation.grader.session.GradingSession`), which sends them to its runners in
the protocol's messages (``Setup.tf32``, ``Setup.device_inputs``, ``CompileBaseline.mode``).
No runner reads them from its environment. The runners apply them
(:mod:`kf.evaluation.runner.baselines`) and say back what they did, and the profile
records what the runners said (``ProfileReport.compile_mode``, ``ProfileReport.tf32``),
never merely what was asked.

- ``compile_baseline`` (``$KF_COMPILE_BASELINE``, default on): profiles also time the
  reference under ``torch.compile``.
- ``compile_mode`` (``$KF_COMPILE_MODE``, ``kf run --compile-mode``): ``default``
  (inductor's default mode, what ``torch.compile(model)`` gives and KernelBench's
  ``torch_compile_inductor_default`` baseline), or ``max-autotune``,
  ``max-autotune-no-cudagraphs``, ``reduce-overhead``. Compiling, and max-autotune's
  autotuning, happen in the first call, which is not timed; the warm-up calls after it
  (CUDA graph recording for the cudagraph modes) are not timed either.
- ``tf32`` (``$KF_TF32``, ``kf run --tf32``): ``off`` (the default: fp32 matmuls and
  convolutions in full fp32, ``torch.backends.cuda.matmul.allow_tf32 = False``,
  ``torch.backends.cudnn.allow_tf32 = False``, ``float32_matmul_precision = "highest"``)
  or ``on`` (TF32 for both, precision ``"high"``). PyTorch's own default is mixed — matmul
  off, cuDNN convolutions on — so kf sets both explicitly, the same in the reference's
  runner and the candidate's.
- ``device_inputs`` (``$KF_DEVICE_INPUTS``, default on): on a GPU, the task's
  ``get_inputs()`` makes its tensors on the device (``off``: on the host, as KernelBench's
  harness does; other values, so other inputs).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kf.config import RunConfig
from kf.evaluation.wire.protocol import COMPILE_MODES, TF32_SETTINGS, BaselineSettingError
from kf.settings import Settings

__all__ = [
    "COMPILE_MODES",
    "TF32_SETTINGS",
    "BaselineSettingError",
    "Conditions",
    "tf32_summary",
]

#: the run-config keys of :class:`Conditions`, and the variable each is made from
VARIABLES = {
    "compile_baseline": "KF_COMPILE_BASELINE",
    "compile_mode": "KF_COMPILE_MODE",
    "tf32": "KF_TF32",
    "device_inputs": "KF_DEVICE_INPUTS",
}


class Conditions(msgspec.Struct, frozen=True, kw_only=True):
    """What a run measures under besides its tolerance (see the module doc); a value kf
    does not know raises :class:`BaselineSettingError`."""

    compile_baseline: bool = True
    compile_mode: str = "default"
    tf32: str = "off"
    device_inputs: bool = True

    def __post_init__(self) -> None:
        _known("compile mode", self.compile_mode, COMPILE_MODES)
        _known("tf32", self.tf32, TF32_SETTINGS)

    @classmethod
    def from_settings(
        cls, settings: Settings, *, compile_mode: str | None = None, tf32: str | None = None
    ) -> Conditions:
        """The conditions ``settings`` ask for (``$KF_COMPILE_BASELINE``,
        ``$KF_COMPILE_MODE``, ``$KF_TF32``, ``$KF_DEVICE_INPUTS``), ``compile_mode`` and
        ``tf32`` (``kf run``'s flags) over theirs; a bad value's error names its variable
        or flag."""
        if compile_mode is None:
            _known("$KF_COMPILE_MODE", settings.compile_mode, COMPILE_MODES)
        if tf32 is None:
            _known("$KF_TF32", settings.tf32, TF32_SETTINGS)
        _known("--compile-mode", compile_mode or "default", COMPILE_MODES)
        _known("--tf32", tf32 or "off", TF32_SETTINGS)
        return cls(
            compile_baseline=settings.compile_baseline,
            compile_mode=compile_mode or settings.compile_mode,
            tf32=tf32 or settings.tf32,
            device_inputs=settings.device_inputs,
        )

    @classmethod
    def of(cls, config: RunConfig) -> Conditions:
        """From a run's config (:meth:`kf.facts.RunStarted.run_config`); what an older log
        did not record takes the default."""
        e, default = config.evaluation, cls()
        return cls(
            compile_baseline=e.compile_baseline,
            compile_mode=e.compile_mode or default.compile_mode,
            tf32=e.tf32 or default.tf32,
            device_inputs=e.device_inputs,
        )

    def config(self) -> dict[str, Any]:
        """The run-config keys that record these conditions."""
        return {k: getattr(self, k) for k in VARIABLES}

    def differences(self, now: Conditions) -> list[str]:
        """How ``now`` differs from these (a logged run's), one phrase per condition."""
        return [
            f"{k} {getattr(self, k)!r} in the log, {getattr(now, k)!r} now"
            for k in VARIABLES
            if getattr(self, k) != getattr(now, k)
        ]


def _known(what: str, value: str, known: tuple[str, ...]) -> None:
    if value not in known:
        raise BaselineSettingError(f"{what} {value!r}: expected one of {', '.join(known)}")


def tf32_summary(precision: dict[str, Any] | None) -> str:
    """One word for a report: ``off``, ``on``, or ``pytorch-default`` (what PyTorch starts
    with: matmul off, cuDNN on), ``""`` when a runner did not say."""
    if not precision:
        return ""
    return str(precision.get("tf32") or "")
