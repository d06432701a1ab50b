"""Which run a search goes into: a new one, or the one its ``--db`` already holds.

A log that holds a run is resumed when the tasks, budget, seed, device, LLM, tolerance and
measuring conditions (compile baseline, compile mode, TF32, device inputs) asked for are
the ones it was started with; otherwise it is refused with the differences named, unless
``--resume`` asks to continue the logged run as it was started (its recorded tolerance and
conditions, whatever the flags and environment say now).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kf.app.request import RunRefused, RunRequest
from kf.config import RunConfig
from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.wire.tolerance import Tolerance
from kf.events import decode_event
from kf.facts import RunStarted
from kf.fold import fold
from kf.kernels.tasks import Task
from kf.log import EventLog
from kf.search_facts import TaskChecked, TaskChecks

__all__ = ["LoggedRun", "differences", "open_log", "run_id_for"]


@dataclass(frozen=True)
class LoggedRun:
    """What a log holds before the search: its run's id and start, and the task checks
    it recorded (the last of each task), or nothing for a new run."""

    run_id: str = ""
    started: RunStarted | None = None
    checks: dict[str, TaskChecked] = field(default_factory=dict)

    @property
    def exists(self) -> bool:
        """Whether the log holds a run to resume."""
        return bool(self.run_id)


def open_log(request: RunRequest) -> LoggedRun:
    """The run ``request.db`` holds (nothing for a new log, or with ``--join``, whose log
    is the deployment's). An empty or unreadable log is refused (:class:`RunRefused`)."""
    db = request.db
    if db is None or request.join or not db.exists():
        return LoggedRun()
    with EventLog(db, readonly=True) as elog:
        first = next(iter(elog.read(1, 1)), None)
        if first is None:
            raise RunRefused(f"{db}: the log is empty; delete it or choose another --db")
        checks = fold(elog.read(types=[TaskChecked.tag]), TaskChecks())
    started = decode_event(first) if first.type == RunStarted.tag else None
    return LoggedRun(
        run_id=first.run_id,
        started=started if isinstance(started, RunStarted) else None,
        checks=checks,
    )


def run_id_for(
    logged: LoggedRun, request: RunRequest, tasks: Sequence[Task], config: RunConfig
) -> tuple[str, list[str]]:
    """The id of the run to search in and how the asked settings differ from it: the
    log's run (refused if they differ, unless ``--resume``), or a new one
    (``request.run_id`` if given). ``config`` is the run's config as asked now."""
    from kf import bus
    from kf.app.orchestra import new_run_id

    if not logged.exists:
        return (bus.valid_run_id(request.run_id) if request.run_id else new_run_id()), []
    differs = differences(logged, tasks, request.seed, config)
    if differs and not request.resume:
        raise RunRefused(
            f"{request.db} holds run {logged.run_id}, started with other settings ("
            + "; ".join(differs)
            + "): pass --resume to continue that run as it was started, or choose "
            "another --db for a new run"
        )
    return logged.run_id, differs


def differences(
    logged: LoggedRun, tasks: Sequence[Task], seed: int, config: RunConfig
) -> list[str]:
    """What differs between the run a log holds and the one asked for now (its tasks,
    ``seed`` and ``config``)."""
    started = logged.started
    if started is None:
        return []
    was = started.run_config()
    out: list[str] = []
    in_log = {t.name: t.sha256 for t in started.tasks}
    asked = {t.name: t.sha256 for t in tasks}
    if in_log != asked:
        changed = sorted(n for n in asked if n in in_log and asked[n] != in_log[n])
        if set(in_log) != set(asked):
            out.append(f"tasks {sorted(in_log)} in the log, {sorted(asked)} now")
        if changed:
            out.append(f"task source changed: {', '.join(changed)}")
    for key, then, now in (
        ("budget", was.search.budget, config.search.budget),
        ("device", was.evaluation.device, config.evaluation.device),
        ("llm", was.llm.llm, config.llm.llm),
    ):
        if then != now:
            out.append(f"{key} {then!r} in the log, {now!r} now")
    if started.seed != seed:
        out.append(f"seed {started.seed} in the log, {seed} now")
    logged_tolerance, tolerance = Tolerance.of(was), Tolerance.of(config)
    if logged_tolerance != tolerance:
        out.append(f"tolerance {_said(logged_tolerance)} in the log, {_said(tolerance)} now")
    return out + Conditions.of(was).differences(Conditions.of(config))


def _said(tolerance: Tolerance) -> str:
    return ", ".join(f"{k} {v!r}" for k, v in tolerance.config().items()) or "the default"
