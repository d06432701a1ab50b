"""A task package's user tests, in a runner (:mod:`kf.kernels.task_packages`).

A reference runner imports them after the task, to refuse a package whose tests do not
import (a ``task_error``); a candidate runner runs them against its loaded candidate, in
the candidate's box like the rest of verification. Each ``test_*`` function is called
with the fixtures its parameters name; the first that raises is the candidate's
failure, reported with the test's name, its message and the line that failed.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from typing import Any

from kf.evaluation.runner.common import RequestFailure, describe_exception, traceback_tail

__all__ = ["import_tests", "run_tests"]


def import_tests(tests: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    """Each test file imported as a module, ``(path, module)``; a file that raises on
    import is a ``task_error`` naming it (the package's fault, not a candidate's)."""
    from kf.kernels.tasks import import_source

    out = []
    for i, (name, source) in enumerate(tests):
        try:
            module = import_source(f"kf_user_test_{i}", source, filename=name)
        except BaseException as exc:
            raise RequestFailure(
                "task_error",
                f"{name}: the user test does not import: {describe_exception(exc)}",
                traceback_tail(),
            ) from exc
        out.append((name, module))
    return out


def run_tests(
    tests: list[tuple[str, str]], fixtures: dict[str, Callable[[], Any]]
) -> tuple[list[str], str, str]:
    """Run every ``test_*`` function of ``tests`` with the fixtures it names (each made
    fresh per test by its maker in ``fixtures``): (the tests that passed, the first that
    failed or "", its message)."""
    passed: list[str] = []
    for name, module in import_tests(tests):
        for fname, fn in vars(module).items():
            if not fname.startswith("test") or not inspect.isfunction(fn):
                continue
            label = f"{name}::{fname}"
            try:
                params = list(inspect.signature(fn).parameters)
                unknown = [p for p in params if p not in fixtures]
                if unknown:
                    msg = f"asks for {', '.join(unknown)} (known: {', '.join(fixtures)})"
                    return passed, label, msg
                fn(**{p: fixtures[p]() for p in params})
            except Exception as exc:
                return passed, label, _message(exc, name)
            passed.append(label)
    return passed, "", ""


def _message(exc: BaseException, filename: str) -> str:
    """The exception, and the test file's line where it was raised."""
    where = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    text = describe_exception(exc)
    if where:
        frame = where[-1]
        text += f" (line {frame.lineno}: {(frame.line or '').strip()})"
    return text
