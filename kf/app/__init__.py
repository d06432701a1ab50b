"""kf's application layer: the work of a command, callable from Python without argparse.

``kf run`` is :class:`RunRequest` → :func:`prepare_run` (refusals, the tasks, the log,
the task check) → :func:`search` (the run, recorded and followed to its end) →
:class:`RunResult` (its report). The command line (:mod:`kf.cli`) parses flags into a
request and prints; a test or a script builds the request itself::

    from kf.app import RunRequest, run
    result = run(RunRequest(tasks=Path("examples/tasks/gelu_bias.py"), budget=4))
"""

from __future__ import annotations

from kf.app.checks import Checked, check_one, check_tasks
from kf.app.opening import LoggedRun, open_log
from kf.app.request import RunRefused, RunRequest
from kf.app.run import RunPlan, RunResult, prepare_run, require_sandbox, run, search

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
