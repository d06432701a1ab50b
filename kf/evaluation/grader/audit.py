"""The task audit: is a task's reference output (nearly) independent of its inputs?

Some KernelBench tasks compute outputs that do not depend on their inputs (level 2's 23,
80 and 83 among others: a reduction followed by subtracting its own mean, a norm over a
dimension of size one…); a "kernel" that returns a constant passes them, and its
speed-up means nothing. So kf audits each task once per run, in a candidate-free
reference runner: the reference's outputs on the verification's trial seeds and on the
first trial's inputs scaled as the hidden distributions are (:mod:`kf.evaluation.runner.variants`).
The task is **degenerate** when a constant answer would pass every one of those input
sets at the run's tolerance: the first set's output as a constant, or all zeros.

The run records a ``kernel.task_audited`` event per task (:class:`TaskAudit`);
``kf report`` marks a degenerate task and flags its best speed-up, and ``kf eval``
prints the audit. ``spread`` is how far the outputs move between input sets, relative
to their size: max |out_i − out_0| / max |out_0|.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kf.evaluation.wire.protocol import Audit
from kf.reports import TaskAudit

if TYPE_CHECKING:
    from kf.evaluation.grader.session import GradingSession

__all__ = ["TaskAudit", "audit_session", "audit_task"]


def audit_task(
    task: Any,
    *,
    device: str = "cpu",
    seed: int = 0,
    trials: int = 5,
    timeout_s: float = 120.0,
    pool: Any = None,
    tolerance: Any = None,
    conditions: Any = None,
) -> TaskAudit:
    """Audit ``task`` in a (reused) reference runner under the run's ``tolerance`` and
    ``conditions``; a failure is recorded, not raised."""
    from kf.evaluation.grader.session import GradingSession

    session = GradingSession(
        task,
        device=device,
        seed=seed,
        pool=pool,
        timeout_s=timeout_s,
        tolerance=tolerance,
        conditions=conditions,
    )
    return audit_session(session, trials)


def audit_session(session: GradingSession, trials: int = 5) -> TaskAudit:
    """:func:`audit_task` of the session's task."""
    from kf.evaluation.grader.grading import SCALES, seed_trials
    from kf.evaluation.grader.sandbox import RunnerError
    from kf.evaluation.grader.session import Stage
    from kf.kernels.tasks import TaskError

    start = time.monotonic()
    stage = Stage(session)
    try:
        with stage.reference_lease(trimmed=True):
            stage.setup_reference()
            stage.load_task()
            reply = stage.reference(
                Audit(
                    seeds=seed_trials(session.seed, trials),
                    scales=[s for s in SCALES if s > 0],
                    tol=session.tol,
                )
            )
    except (TaskError, RunnerError) as exc:
        return TaskAudit(degenerate=False, error=str(exc), duration_s=time.monotonic() - start)
    return TaskAudit(
        degenerate=reply.degenerate,
        reason=reply.reason,
        input_sets=reply.input_sets,
        spread=reply.spread,
        constant_passes=reply.constant_passes,
        duration_s=time.monotonic() - start,
    )
