"""The compile stage: the candidate built and imported in a fresh runner, with the
static checks' warnings.
"""

from __future__ import annotations

import time

import msgspec

from kf.evaluation.device import parse_device
from kf.evaluation.grading import (
    _build_niceness,
    _candidate,
    _CandidateFailed,
    _Deadline,
    _phases,
    _sandboxed,
    _setup,
    _truncate,
    log,
)
from kf.evaluation.reports import CompileReport
from kf.evaluation.sandbox import Limits, RunnerHandle, RunnerPool, default_pool
from kf.static_checks import check_source
from kf.tasks import Task


def compile_candidate(
    task: Task,
    source: str,
    *,
    device: str = "cpu",
    timeout_s: float | None = None,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
) -> CompileReport:
    """Import the candidate and construct ``ModelNew(*get_init_inputs())`` in a sandbox.

    ``timeout_s`` is the build limit (None: :func:`kf.evaluation.buildlimits.build_timeout_s`,
    600 s by default); it starts once the build holds one of the process's build slots,
    and the wait for one is the report's ``build_queue`` phase. Raises
    :class:`TaskError` when the task itself is broken.
    """
    from kf.evaluation.buildlimits import build_slot, build_timeout_s

    leased: list[RunnerHandle] = []
    with build_slot() as queued_s:
        report = _compile(
            task,
            source,
            leased,
            device=device,
            timeout_s=build_timeout_s(timeout_s),
            limits=limits,
            pool=pool,
        )
    phases = {**report.phases, "build_queue": round(queued_s, 4)}
    return _sandboxed(msgspec.structs.replace(report, phases=phases), leased)


def _compile(
    task: Task,
    source: str,
    leased: list[RunnerHandle],
    *,
    device: str,
    timeout_s: float,
    limits: Limits | None,
    pool: RunnerPool | None,
) -> CompileReport:
    """:func:`compile_candidate`; the runner it leases is added to ``leased``."""
    device = parse_device(device)
    pool = pool or default_pool()
    limits = limits or Limits()
    static = check_source(source)
    since = time.monotonic()
    with pool.lease() as cand:
        leased.append(cand)
        start = time.monotonic()
        deadline = _Deadline(timeout_s)
        try:
            _setup(cand, device, limits, deadline, nice=_build_niceness())
            _candidate(
                task,
                cand,
                "load_candidate",
                deadline,
                source=source,
                seed=0,
                task_source=task.source,
                task_name=task.name,
                init=None,
                what="import and construction of ModelNew",
            )
            # kf.cuda's build reports (resources, cache hits) from the runner's log
            build_log = "\n".join(
                line for line in cand.log_tail().splitlines() if line.startswith("kf.cuda")
            )
        except _CandidateFailed as exc:
            log.info("candidate_compile_failed", task=task.name, kind=exc.kind)
            return CompileReport(
                ok=False,
                error=exc.error,
                log=_truncate(exc.log),
                duration_s=time.monotonic() - start,
                failure_kind=exc.kind,
                warnings=static + tuple(cand.findings),
                phases=_phases(since, cand),
            )
        warnings = static + tuple(cand.findings)
    log.info("candidate_compiled", task=task.name, warnings=warnings)
    return CompileReport(
        ok=True,
        log=build_log,
        duration_s=time.monotonic() - start,
        warnings=warnings,
        phases=_phases(since, cand),
    )
