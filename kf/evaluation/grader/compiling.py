"""The compile stage: the candidate built and imported in a fresh runner, with the
static checks' warnings. A boxed runner that built the candidate is kept for the
candidate's verification when the session names the candidate
(:attr:`~kf.evaluation.grader.session.GradingSession.candidate_key`).
"""

from __future__ import annotations

import time

import msgspec

from kf.evaluation.grader import box
from kf.evaluation.grader.grading import CandidateFailed, build_niceness, log, truncate
from kf.evaluation.grader.sandbox import Limits, RunnerPool
from kf.evaluation.grader.session import GradingSession, Stage
from kf.evaluation.wire.protocol import LoadCandidate
from kf.kernels.static_checks import check_source
from kf.kernels.tasks import Task
from kf.reports import CompileReport


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

    ``timeout_s`` is the build limit (None:
    :func:`kf.buildlimits.build_timeout_s`, 600 s by default); it starts
    once the build holds one of the process's build slots, and the wait for one is the
    report's ``build_queue`` phase. Raises :class:`TaskError` when the task itself is
    broken.
    """
    session = GradingSession(task, source, device=device, pool=pool, limits=limits or Limits())
    return compile_session(session, timeout_s)


def compile_session(session: GradingSession, timeout_s: float | None = None) -> CompileReport:
    """:func:`compile_candidate` of the session's candidate; ``timeout_s`` is the build
    limit (None: ``$KF_BUILD_TIMEOUT_S`` or 600 s), not the session's."""
    from kf.buildlimits import build_slot, build_timeout_s

    with build_slot() as queued_s:
        stage = Stage(session, build_timeout_s(timeout_s))
        report = _compile(stage)
    phases = {**report.phases, "build_queue": round(queued_s, 4)}
    return stage.sandboxed(msgspec.structs.replace(report, phases=phases))


def _compile(stage: Stage) -> CompileReport:
    """:func:`compile_session` in ``stage``."""
    task, source = stage.task, stage.session.source
    static = check_source(source)
    with stage.candidate_lease() as cand:
        start = time.monotonic()
        stage.restart_clock()
        # a boxed runner asks the grader for its builds, which run niced in a build box
        # (kf.evaluation.grader.builds); an unboxed one builds itself, niced, and a niced
        # runner cannot be reset for the candidate's verification, so it is not kept
        boxed = cand.sandbox != box.MODE_UNSAFE
        try:
            stage.setup_candidate(nice=0 if boxed else build_niceness(stage.session.grader))
            stage.candidate(
                LoadCandidate(source=source, seed=0, task_source=task.source, task_name=task.name),
                what="import and construction of ModelNew",
            )
            # kf.cuda's build reports (resources, cache hits) from the runner's log
            build_log = "\n".join(
                line for line in cand.log_tail().splitlines() if line.startswith("kf.cuda")
            )
        except CandidateFailed as exc:
            log.info("candidate_compile_failed", task=task.name, kind=exc.kind)
            return CompileReport(
                ok=False,
                error=exc.error,
                log=truncate(exc.log),
                duration_s=time.monotonic() - start,
                failure_kind=exc.kind,
                warnings=static + tuple(cand.findings),
                phases=stage.phases(),
            )
        warnings = static + tuple(cand.findings)
        if boxed:
            stage.keep_candidate()  # for the candidate's verification
    log.info("candidate_compiled", task=task.name, warnings=warnings)
    return CompileReport(
        ok=True,
        log=build_log,
        duration_s=time.monotonic() - start,
        warnings=warnings,
        phases=stage.phases(),
    )
