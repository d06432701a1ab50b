"""Evaluate candidates: compile, verify and profile, each in sandboxed runner processes."""

from kf.evaluation.compiling import compile_candidate
from kf.evaluation.device import DeviceError, parse_device
from kf.evaluation.pipeline import evaluate
from kf.evaluation.profiling import profile_candidate
from kf.evaluation.reports import (
    FAILURE_KINDS,
    CompileReport,
    EvalResult,
    ProfileReport,
    TrialEvidence,
    VerifyReport,
)
from kf.evaluation.sandbox import Limits, RunnerPool, default_pool
from kf.evaluation.verifying import verify_candidate

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
