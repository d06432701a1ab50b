"""kf's application layer: the work of a command, callable from Python without argparse.

``kf run`` is :class:`RunRequest` → :func:`prepare_run` (refusals, the tasks, the log,
the task check) → :func:`search` (the run, recorded and followed to its end) →
:class:`RunResult` (its report). The command line (:mod:`kf.app.cli`) parses flags into a
request and prints; a test or a script builds the request itself::

    from kf.app import RunRequest, run
    result = run(RunRequest(tasks=Path("examples/tasks/gelu_bias.py"), budget=4))
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kf.app.checks import Checked, check_one, check_tasks
    from kf.app.opening import LoggedRun, open_log
    from kf.app.request import RunRefused, RunRequest
    from kf.app.run import RunPlan, RunResult, prepare_run, require_sandbox, run, search

#: each public name and the module that defines it, loaded on first use: a command that
#: needs one module of the application (``kf report``, ``kf --help``) does not load the
#: composition of a run with it
_WHERE = {
    "Checked": "kf.app.checks",
    "check_one": "kf.app.checks",
    "check_tasks": "kf.app.checks",
    "LoggedRun": "kf.app.opening",
    "open_log": "kf.app.opening",
    "RunRefused": "kf.app.request",
    "RunRequest": "kf.app.request",
    "RunPlan": "kf.app.run",
    "RunResult": "kf.app.run",
    "prepare_run": "kf.app.run",
    "require_sandbox": "kf.app.run",
    "run": "kf.app.run",
    "search": "kf.app.run",
}


class _Package(types.ModuleType):
    """``kf.app`` itself: its ``run`` is the function, which importing the module
    ``kf.app.run`` (the import system then sets the package's attribute) must not hide."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "Checked",
    "LoggedRun",
    "RunPlan",
    "RunRefused",
    "RunRequest",
    "RunResult",
    "check_one",
    "check_tasks",
    "open_log",
    "prepare_run",
    "require_sandbox",
    "run",
    "search",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kf.app' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
