"""Evaluate candidates: compile, verify and profile, each in sandboxed runner processes.

The package's names are imported on first use (PEP 562), so importing one of its
modules, or an event type that embeds a report, does not load the whole wing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: each public name and the module that defines it
_WHERE = {
    "compile_candidate": "compiling",
    "compile_session": "compiling",
    "DeviceError": "device",
    "parse_device": "device",
    "evaluate": "pipeline",
    "Timing": "profiling",
    "profile_candidate": "profiling",
    "profile_session": "profiling",
    "FAILURE_KINDS": "reports",
    "CompileReport": "reports",
    "EvalResult": "reports",
    "ProfileReport": "reports",
    "TrialEvidence": "reports",
    "VerifyReport": "reports",
    "Limits": "sandbox",
    "RunnerPool": "sandbox",
    "default_pool": "sandbox",
    "GradingSession": "session",
    "verify_candidate": "verifying",
    "verify_session": "verifying",
}

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


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kf.evaluation' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kf.evaluation.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
