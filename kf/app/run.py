"""A search, start to end, callable from Python: what ``kf run`` does, without argparse.

Two steps. :func:`prepare_run` refuses what cannot run faithfully (one line each), loads
the tasks, opens the log (a new run, or the one ``--db`` holds), and checks the tasks
(:mod:`kf.app.checks`); nothing is started and no log is written before it returns, so a
bad task loses nothing. :func:`search` then starts the run (or resumes it), records the
task checks in its log, follows it to its end and reports. :func:`run` does both::

    from kf.app import RunRequest, run
    result = run(RunRequest(tasks=Path("examples/tasks/gelu_bias.py"), budget=4))
    result.report["tasks"][0]["best_speedup"]

``kf run`` adds the process's signal handling (:mod:`kf.shutdown`) and prints.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import msgspec

from kf.app.checks import check_tasks
from kf.app.opening import LoggedRun, open_log, run_id_for
from kf.app.request import RunRefused, RunRequest
from kf.config import Evaluation, RunConfig, Search, Tasks, Trust, Tuning
from kf.evaluation.grader.baseline_settings import Conditions
from kf.events import Envelope
from kf.kernels.tasks import Task, TaskError

if TYPE_CHECKING:
    from kf.app.orchestra import RunOptions
    from kf.settings import Settings

__all__ = ["RunPlan", "RunResult", "prepare_run", "run", "search"]


@dataclass
class RunPlan:
    """A run ready to start: its tasks (checked), the tasks left out with their reasons,
    the process's settings for it, and lines to show when it starts."""

    request: RunRequest
    tasks: list[Task]
    skipped: list[tuple[str, str]]
    options: RunOptions
    notes: list[str] = field(default_factory=list)


@dataclass
class RunResult:
    """A finished run: its id, log, committed envelopes and ``kf report``'s report."""

    run_id: str
    db: Path | None  # None: a --join run, whose log is the deployment's
    envelopes: list[Envelope]
    report: dict[str, Any]

    @property
    def unrunnable(self) -> str | None:
        """Why the run's devices could run none of its candidates (None if any ran)."""
        reasons = []
        for t in self.report["tasks"]:
            unroutable = t.get("failures", {}).get("unroutable", 0)
            skipped = t.get("skipped") or ""
            if t["candidates"] and unroutable == t["candidates"]:
                reasons.append(f"{t['task']}: all {unroutable} candidates unroutable")
            elif not t["candidates"] and skipped.startswith("no live device"):
                reasons.append(f"{t['task']}: {skipped}")
            else:
                return None
        return "; ".join(reasons) or None


def prepare_run(request: RunRequest) -> RunPlan:
    """Everything before the run starts (see the module doc). Raises :class:`RunRefused`
    (bad input or settings, one line); ``KeyboardInterrupt`` while the tasks are checked
    reaches the caller, with no run started."""
    from kf.devices.slots import DeviceError, parse_devices, primary_device
    from kf.settings import current

    refuse_early(request)
    settings = current()  # the process's settings, read once for the run
    try:
        # a joined run's workers have the devices; here only the kind matters
        devices = [] if request.join else parse_devices(request.device)
    except DeviceError as exc:
        raise RunRefused(str(exc)) from exc
    device = devices[0] if devices else primary_device(request.device)
    skipped: list[tuple[str, str]] = []
    try:
        tasks, skipped = _load(request)
        logged = open_log(request)
        # the run's measuring conditions: a logged run's as it recorded them
        logged_config = logged.started.run_config() if logged.started else None
        asked = asked_conditions(request, settings)
        conditions = Conditions.of(logged_config) if logged_config else asked
        if not request.join:  # a joined deployment's workers check on their own devices
            if request.local_worker:
                from kf.app.orchestra import prepare_worker

                prepare_worker(request.device)
            else:  # the check is all this process evaluates: no idle runners warmed for later
                from kf.evaluation.grader.sandbox import configure_default_pool

                configure_default_pool(size=0, warm=settings.runner_warm)
            checked = check_tasks(
                tasks,
                device,
                recorded=logged.checks,
                single=_single(request.tasks),
                conditions=conditions,
            )
            tasks, records = checked.passed, checked.made
            skipped += checked.failed
        else:
            records = []
        if not tasks:
            raise TaskError(f"{request.tasks}: no usable task ({len(skipped)} skipped)")
        config = run_config(request, devices, device, skipped, conditions=asked)
        run_id, differs = run_id_for(logged, request, tasks, config)
        lessons = _lessons_loaded(request, logged)
    except (TaskError, ValueError) as exc:  # DeviceError and LogError are ValueErrors
        raise RunRefused(str(exc), skipped) from exc
    options = _options(request, devices, device, run_id, logged, config)
    options.measure_device = settings.device_measure  # this machine's knob, not the run's
    options.records = list(records)
    if lessons is not None:
        options.records.append((lessons, time.time()))
    notes = (
        [f"kf run: resuming {run_id} as it was started (" + "; ".join(differs) + ")"]
        if differs
        else []
    )
    return RunPlan(request=request, tasks=tasks, skipped=skipped, options=options, notes=notes)


def refuse_early(request: RunRequest) -> None:
    """What is refused before anything is loaded or checked (:class:`RunRefused`)."""
    if request.budget < 1:
        raise RunRefused("--budget must be at least 1")
    if request.db and not request.join:  # one writer per log: say so before anything starts
        from kf.log import LogLocked, check_writable

        try:
            check_writable(request.db)
        except LogLocked as exc:
            raise RunRefused(str(exc)) from exc
    if request.nats_url:  # a bus without per-role users is refused
        from kf.auth import shared_login_refusal

        roles = ["proposer"] if request.join else ["archivist", "proposer"]
        roles += ["worker"] if request.local_worker else []
        logins = [request.bus_options.for_role(r) for r in roles]
        why = shared_login_refusal("run", logins, request.allow_shared_token)
        if why:
            raise RunRefused(why)
    if not (request.join and not request.local_worker):  # the checks and the worker run code
        refused = require_sandbox(request.unsafe_no_sandbox)
        if refused:
            raise RunRefused(refused)


def require_sandbox(unsafe: bool) -> str | None:
    """Why candidates cannot be boxed here (None: they can, or ``unsafe``, which runs them
    outside kf's box from now on in this process)."""
    from kf.evaluation.grader.box import SandboxUnavailable, require
    from kf.settings import apply

    if unsafe:
        apply({"KF_UNSAFE_NO_SANDBOX": "1"})
    try:
        require()
    except SandboxUnavailable as exc:
        return str(exc)
    return None


def _load(request: RunRequest) -> tuple[list[Task], list[tuple[str, str]]]:
    """The tasks asked for; in a folder, a file that does not load is skipped with its
    reason and the others run."""
    from kf.kernels.task_folders import load_tasks_skipping

    tasks, skipped = load_tasks_skipping(request.tasks, shape_cap=request.shape_cap)
    if request.select is None:
        return tasks, skipped
    from kf.app.task_select import SelectionError, select_loaded

    if not request.tasks.is_dir():
        raise TaskError(f"--tasks chooses tasks of a folder; {request.tasks} is a file")
    try:
        return select_loaded(tasks, skipped, request.select, lambda t: t.name)
    except SelectionError as exc:
        raise TaskError(f"{request.tasks}: {exc}") from exc


def _single(path: Path) -> bool:
    """Whether the run is of one task (a file, or a task package): a failed check refuses
    it. A folder's tasks (a robust-kbench folder's two passes included) are left out one
    by one, with their reasons."""
    from kf.kernels.task_packages import is_package

    return not path.is_dir() or is_package(path)


def _options(
    request: RunRequest,
    devices: list[str],
    device: str,
    run_id: str,
    logged: LoggedRun,
    config: RunConfig,
) -> RunOptions:
    """The process's settings of the run (:class:`kf.app.orchestra.RunOptions`), with its
    config."""
    from kf.app.orchestra import RunOptions

    return RunOptions(
        request=request,
        device=device,
        devices=devices if request.local_worker else [],
        db=request.db or Path("runs") / f"{run_id}.db",
        run_id=run_id,
        max_in_flight=config.search.max_in_flight,
        resuming=logged.exists,
        config=config,
    )


def run_config(
    request: RunRequest,
    devices: list[str],
    device: str,
    skipped: list[tuple[str, str]],
    *,
    conditions: Conditions,
) -> RunConfig:
    """The run's config (:class:`kf.config.RunConfig`), made once from what was asked and
    what was resolved from it: the devices, the tasks left out, the measuring
    ``conditions`` (:func:`asked_conditions`), the devices trusted. ``kf run`` records it;
    the search version and the offline mutator's name are stamped by
    :mod:`kf.app.orchestra`."""
    from kf.devices.slots import default_in_flight

    local = devices if request.local_worker else []
    # the LLM's and the tolerance's options come as their converters give them
    given = RunConfig.decode({**request.llm, **request.tolerance})
    trusted = _trusted_devices(request, devices or [device])
    return RunConfig(
        search=Search(
            budget=request.budget,
            islands=request.islands,
            # two candidates in flight per local CPU, 24 per local GPU, unless told
            max_in_flight=request.max_in_flight
            if request.max_in_flight is not None
            else default_in_flight(local),
            mutator=given.search.mutator,
        ),
        tuning=Tuning(tune_budget=request.tune_budget),
        evaluation=Evaluation(
            device=device,
            # several local devices: which (one device's config is as before)
            devices=tuple(local) if len(local) > 1 else (),
            **msgspec.structs.asdict(conditions),
            atol=given.evaluation.atol,
            rtol=given.evaluation.rtol,
            tolerance=given.evaluation.tolerance,
        ),
        # other devices' archive-bound results are measured twice
        trust=Trust(confirm_trusted=tuple(trusted) if trusted is not None else None),
        llm=msgspec.structs.replace(given.llm, llm=bool(request.llm_url)),
        agents=given.agents,
        tasks=Tasks(
            skipped_tasks=dict(skipped),
            task_selection=request.select,
            shape_cap=request.shape_cap,  # robust-kbench configs capped
        ),
    )


def asked_conditions(request: RunRequest, settings: Settings) -> Conditions:
    """The measuring conditions ``request`` asks for: its ``--compile-mode`` and ``--tf32``
    (a flag's or a ``--config`` file's) over the process's ``settings``
    (:class:`~kf.evaluation.grader.baseline_settings.Conditions`; a bad value raises its
    ``BaselineSettingError``, a ``ValueError``)."""
    return Conditions.from_settings(settings, compile_mode=request.compile_mode, tf32=request.tf32)


def _trusted_devices(request: RunRequest, devices: list[str]) -> list[str] | None:
    """The run's own worker's device ids (as kf.app.orchestra names them), those given
    with ``--trust`` and those of ``KF_TRUSTED_DEVICES`` (kf.auth.trusted_devices)."""
    from hardware_agents.cpu import host_id
    from kf.auth import trusted_devices
    from kf.devices.slots import device_slots

    local = [] if request.join or not request.local_worker else devices
    own = [s.device_id for s in device_slots(local, host_id())] if local else []
    return trusted_devices(own, request.trust)


async def search(plan: RunPlan, *, out: TextIO = sys.stdout) -> RunResult:
    """Start (or resume) the planned run, record its task checks, follow it to its end
    with progress on ``out``, and report. The exceptions of
    :func:`kf.app.orchestra.run_search` (``PartDied``, ``ConnectionError``, ``ValueError``)
    reach the caller."""
    from kf.app.orchestra import run_search
    from kf.app.report import build_report_from

    for line in plan.notes:
        print(line, file=out, flush=True)
    run_id, envelopes = await run_search(plan.tasks, plan.options, out=out)
    db = None if plan.request.join else plan.options.db
    if plan.request.lessons is not None and not plan.request.join:
        from kf.app.lessons_cmd import write_back

        print(write_back(plan.request.lessons, envelopes), file=out, flush=True)
    return RunResult(run_id=run_id, db=db, envelopes=envelopes, report=build_report_from(envelopes))


def run(request: RunRequest, *, out: TextIO = sys.stdout) -> RunResult:
    """:func:`prepare_run`, then :func:`search` in a new event loop."""
    return asyncio.run(search(prepare_run(request), out=out))


def _lessons_loaded(request: RunRequest, logged: LoggedRun) -> Any:
    """The ``lesson.loaded`` a new run records from ``--lessons`` (None: no library, or a
    resumed run, which has its own); a library kf cannot read raises a ValueError."""
    if request.lessons is None or logged.started is not None:
        return None
    from kf.app.lessons_cmd import loaded_event

    return loaded_event(request.lessons)
