"""Evaluate candidates: compile, verify and profile, each in sandboxed runner processes.

Two packages with a wall between them: :mod:`kf.evaluation.grader` (the agent's side,
which never runs candidate code) and :mod:`kf.evaluation.runner` (what runs inside a
box); they share only :mod:`kf.evaluation.wire` (the protocol's structs).

The package's names are imported on first use (PEP 562), so importing one of its
modules, or an event type that embeds a report, does not load the whole wing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kf.devices.names import DeviceError, parse_device
    from kf.evaluation.grader.compiling import compile_candidate, compile_session
    from kf.evaluation.grader.pipeline import evaluate
    from kf.evaluation.grader.profiling import Timing, profile_candidate, profile_session
    from kf.evaluation.grader.sandbox import Limits, RunnerPool, default_pool
    from kf.evaluation.grader.session import GradingSession
    from kf.evaluation.grader.verifying import verify_candidate, verify_session
    from kf.reports import (
        FAILURE_KINDS,
        CompileReport,
        EvalResult,
        ProfileReport,
        TrialEvidence,
        VerifyReport,
    )

#: each public name and the module that defines it
_WHERE = {
    "compile_candidate": "kf.evaluation.grader.compiling",
    "compile_session": "kf.evaluation.grader.compiling",
    "DeviceError": "kf.devices.names",
    "parse_device": "kf.devices.names",
    "evaluate": "kf.evaluation.grader.pipeline",
    "Timing": "kf.evaluation.grader.profiling",
    "profile_candidate": "kf.evaluation.grader.profiling",
    "profile_session": "kf.evaluation.grader.profiling",
    "FAILURE_KINDS": "kf.reports",
    "CompileReport": "kf.reports",
    "EvalResult": "kf.reports",
    "ProfileReport": "kf.reports",
    "TrialEvidence": "kf.reports",
    "VerifyReport": "kf.reports",
    "Limits": "kf.evaluation.grader.sandbox",
    "RunnerPool": "kf.evaluation.grader.sandbox",
    "default_pool": "kf.evaluation.grader.sandbox",
    "GradingSession": "kf.evaluation.grader.session",
    "verify_candidate": "kf.evaluation.grader.verifying",
    "verify_session": "kf.evaluation.grader.verifying",
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
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
