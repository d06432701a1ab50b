"""The task check, a step of the run: each task's reference loads, runs and gives outputs
in a sandboxed runner (:func:`kf.evaluation.grader.task_check.run_task_check`) before the
run searches it.

Each check is an observation the run records (``kernel.task_checked``, right after
``run.started``), passed or failed, so the log says which tasks were checked, where, and
what they gave. A task that fails is left out of a folder's run with its reason; a single
task file that fails is the run's one-line error, and no run is started.

On resume a task is not checked again when the log recorded a check of the same source
on the same device: the resumed run goes on with the tasks its ``run.started`` fixed, so
a new check could not change them, and a reference that a changed environment broke is
still caught by every verification, which runs it (``task_error``). A task the log has
no such check for (another device, a log from before the check was recorded) is checked
and the check recorded.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.grader.task_check import run_task_check
from kf.kernels.tasks import Task, TaskError
from kf.search_facts import TaskChecked

__all__ = ["Checked", "check_one", "check_tasks"]


@dataclass
class Checked:
    """The outcome of the check step: the tasks that passed, the ``(file, reason)`` of
    those that failed, and the checks made now, each with the time it ended (those reused
    from the log are not made again)."""

    passed: list[Task] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    made: list[tuple[TaskChecked, float]] = field(default_factory=list)


def check_one(task: Task, device: str, conditions: Conditions | None = None) -> TaskChecked:
    """Check ``task`` on ``device`` now; a :class:`~kf.devices.DeviceError` (no such
    device here) propagates, a broken task is a failed check with its reason."""
    began = time.monotonic()
    try:
        info, error = run_task_check(task, device=device, conditions=conditions), ""
    except TaskError as exc:
        info, error = None, str(exc)
    return TaskChecked(
        task=task.name,
        sha256=task.sha256,
        path=task.path,
        device=device,
        ok=info is not None,
        info=info,
        error=error,
        duration_s=round(time.monotonic() - began, 3),
    )


def check_tasks(
    tasks: Sequence[Task],
    device: str,
    *,
    recorded: Mapping[str, TaskChecked],
    single: bool,
    conditions: Conditions | None = None,
) -> Checked:
    """Check each task on ``device``, reusing a check ``recorded`` in the log for the same
    source and device. With ``single`` (a task file, not a folder) a failed check raises
    :class:`TaskError` with its reason; otherwise the task is left out."""
    out = Checked()
    for task in tasks:
        before = recorded.get(task.name)
        if before is not None and (before.sha256, before.device) == (task.sha256, device):
            checked = before
        else:
            checked = check_one(task, device, conditions)
            out.made.append((checked, time.time()))
        if checked.ok:
            out.passed.append(task)
        elif single:
            raise TaskError(checked.error)
        else:
            out.failed.append((task.path or task.name, checked.error))
    return out
