"""Evaluate candidates: compile, verify and profile, each in sandboxed runner processes."""

from kf.evaluation.device import DeviceError, parse_device
from kf.evaluation.reports import (
    FAILURE_KINDS,
    CompileReport,
    EvalResult,
    ProfileReport,
    TrialEvidence,
    VerifyReport,
)
from kf.evaluation.sandbox import Limits, RunnerPool, default_pool
from kf.evaluation.stages import (
    compile_candidate,
    evaluate,
    profile_candidate,
    verify_candidate,
)

__all__ = [
    "FAILURE_KINDS",
    "CompileReport",
    "DeviceError",
    "EvalResult",
    "Limits",
    "ProfileReport",
    "RunnerPool",
    "TrialEvidence",
    "VerifyReport",
    "compile_candidate",
    "default_pool",
    "evaluate",
    "parse_device",
    "profile_candidate",
    "verify_candidate",
]
