"""Evaluate candidates: compile, verify and profile, each in sandboxed runner processes."""

from kf.evaluation.compiling import compile_candidate, compile_session
from kf.evaluation.device import DeviceError, parse_device
from kf.evaluation.pipeline import evaluate
from kf.evaluation.profiling import Timing, profile_candidate, profile_session
from kf.evaluation.reports import (
    FAILURE_KINDS,
    CompileReport,
    EvalResult,
    ProfileReport,
    TrialEvidence,
    VerifyReport,
)
from kf.evaluation.sandbox import Limits, RunnerPool, default_pool
from kf.evaluation.session import GradingSession
from kf.evaluation.verifying import verify_candidate, verify_session

__all__ = [
    "FAILURE_KINDS",
    "CompileReport",
    "DeviceError",
    "EvalResult",
    "GradingSession",
    "Limits",
    "ProfileReport",
    "RunnerPool",
    "Timing",
    "TrialEvidence",
    "VerifyReport",
    "compile_candidate",
    "compile_session",
    "default_pool",
    "evaluate",
    "parse_device",
    "profile_candidate",
    "profile_session",
    "verify_candidate",
    "verify_session",
]
