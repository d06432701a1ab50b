"""The whole evaluation, as ``kf eval`` runs it: compile, verify, profile (by the
profiling policy, :mod:`kf.evaluation.grader.policy`), and counters when asked.

Each candidate runs in one sandboxed runner of its own from its build to its profile
(kept between the stages, on a GPU only where ``$KF_KEPT_RUNNERS`` is set; never one that
ran another candidate; re-verification and counters start fresh ones). The grader (this
process) never imports task or candidate code and never unpickles what a runner sends: it
forwards payloads between a candidate runner and a candidate-free reference runner, which
holds the expected outputs and judges them. The stages: :mod:`~kf.evaluation.grader.compiling`,
:mod:`~kf.evaluation.grader.verifying`, :mod:`~kf.evaluation.grader.profiling`,
:mod:`~kf.evaluation.grader.counters`, each given one
:class:`~kf.evaluation.grader.session.GradingSession`;
what they share: :mod:`~kf.evaluation.grader.grading`.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from typing import Any

from kf.evaluation.grader.audit import audit_task
from kf.evaluation.grader.compiling import compile_session
from kf.evaluation.grader.counters import COUNTERS_TIMEOUT_S, counters_session
from kf.evaluation.grader.policy import stated_profile
from kf.evaluation.grader.sandbox import Limits, RunnerPool
from kf.evaluation.grader.session import GradingSession
from kf.evaluation.grader.verifying import verify_session
from kf.evaluation.wire.tolerance import Tolerance
from kf.kernels.tasks import Task
from kf.reports import EvalResult


def evaluate(
    task: Task,
    source: str,
    *,
    device: str = "cpu",
    seed: int = 0,
    pool: RunnerPool | None = None,
    limits: Limits | None = None,
    timeout_s: float = 120.0,
    profile_options: dict[str, Any] | None = None,
    profile: bool = True,
    counters: bool = False,
    tolerance: Tolerance | None = None,
    build_timeout_s: float | None = None,
    audit: bool = False,
) -> EvalResult:
    """Compile, verify (with the generalisation gate), and when correct profile; ``kf eval``.

    A speed-up above :data:`REVERIFY_ABOVE` is re-verified before it is reported; with
    ``counters``, a profiled candidate is run once more under ncu (:func:`collect_counters`).
    ``profile_options`` go to :func:`profile_candidate` (``min_time_s``, ``warmup``…).
    ``timeout_s`` limits verification and profiling; ``build_timeout_s`` the build (None:
    ``$KF_BUILD_TIMEOUT_S`` or 600 s); ``tolerance`` is the run's (None: the task's own,
    else KernelBench's). With ``audit``, the task is audited too (is it degenerate?
    :mod:`kf.evaluation.grader.audit`).
    """
    # one key for this candidate's stages: its build's runner verifies it, that one
    # profiles it (a boxed runner; never another candidate's)
    key = f"eval:{uuid.uuid4().hex}"
    session = GradingSession(
        task, source, device=device, seed=seed, pool=pool, limits=limits or Limits(),
        timeout_s=timeout_s, tolerance=tolerance, candidate_key=key,
    )  # fmt: skip
    try:
        return _stages(session, audit, build_timeout_s, profile, counters, profile_options)
    finally:  # a stage that kept the runner for a next one that did not come
        if session.kept_key is not None:
            session.runners.drop_kept(session.kept_key)


def _stages(
    session: GradingSession,
    audit: bool,
    build_timeout_s: float | None,
    profile: bool,
    counters: bool,
    profile_options: dict[str, Any] | None,
) -> EvalResult:
    """:func:`evaluate` of the session's candidate."""
    task, source, device, seed = session.task, session.source, session.device, session.seed
    pool, tolerance = session.pool, session.tolerance
    audited = (
        audit_task(task, device=device, seed=seed, pool=pool, tolerance=tolerance)
        if audit
        else None
    )
    result = functools.partial(EvalResult, task=task.name, device=device, seed=seed, audit=audited)
    compiled = compile_session(session, build_timeout_s)
    if not compiled.ok:
        return result(compile=compiled)
    verified = verify_session(session)
    if not verified.correct or not profile:
        return result(compile=compiled, verify=verified)
    # kf's one profiling policy, as the profiler agent of `kf run` applies it; a lone
    # evaluation has no earlier sessions and no incumbent, so of its guards only the
    # re-verification above 10x can apply here
    profiled = stated_profile(
        task,
        source,
        device=device,
        seed=seed,
        pool=pool,
        limits=session.limits,
        timeout_s=session.timeout_s,
        tolerance=tolerance,
        candidate_key=session.candidate_key,
        **(profile_options or {}),
    )
    # ncu replays every kernel: the counters have a time limit of their own
    measured = (
        counters_session(dataclasses.replace(session, timeout_s=COUNTERS_TIMEOUT_S))
        if counters and profiled.ok
        else None
    )
    return result(compile=compiled, verify=verified, profile=profiled, counters=measured)
