"""The ``torch.compile`` baseline: its limits and cache, and its compilation in the
reference runner (whether it is wanted, and its mode, are the run's conditions:
:class:`kf.evaluation.grader.baseline_settings.Conditions`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from kf.evaluation.grader.grading import log
from kf.evaluation.grader.sandbox import RunnerCrashed, RunnerFailed, RunnerHandle, RunnerTimeout
from kf.evaluation.grader.session import GradingSession, Stage
from kf.evaluation.wire.protocol import BaselineCompiled, CompileBaseline, MakeInputs
from kf.settings import Settings


def _inductor_cache_dir(settings: Settings) -> str | None:
    """Where reference runners keep inductor's caches: ``$KF_CACHE_DIR/inductor`` (or
    ``~/.cache/kf/inductor``), so a fresh reference runner recompiles a task's reference
    from the cache in about a second; None (the runner's own scratch directory, lost
    with it) with ``$KF_COMPILE_CACHE=0``, and None when ``$TORCHINDUCTOR_CACHE_DIR``
    is set (runners inherit it)."""
    if not settings.compile_cache:
        return None
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return None
    if not settings.unsafe_no_sandbox:
        # boxed runners see the shared cache read-only, and a cache every runner could
        # write would let a candidate plant pickles for the next reference runner: inside
        # the box inductor compiles into the runner's own scratch, lost with it
        return None
    return os.path.join(settings.cache_dir, "inductor")


class BaselineLost(Exception):
    """The reference runner died or hung compiling or timing the compiled reference."""


# baseline compiles that killed or hung their runner, per reference key and seed: not
# tried again in this process
baseline_lost: dict[str, str] = {}


def compile_reference(session: GradingSession, ref: RunnerHandle, want: bool) -> BaselineCompiled:
    """Have the reference runner compile the session's reference for its current inputs in
    the run's compile mode (or find it compiled), if ``want``: its reply, with ``error``
    set when there is no compiled baseline."""
    if not want:
        return BaselineCompiled(error="turned off (compile_baseline off: $KF_COMPILE_BASELINE=0)")
    task = session.task
    lost_key = f"{session.reference_key}:{session.seed}"
    if lost_key in baseline_lost:
        return BaselineCompiled(error=baseline_lost[lost_key], cached=True)
    try:
        reply = ref.request(
            CompileBaseline(
                cache_dir=_inductor_cache_dir(session.grader), mode=session.cond.compile_mode
            ),
            # one compile's own limit ($KF_COMPILE_BASELINE_TIMEOUT_S, 600 s), not the profile's
            session.grader.compile_baseline_timeout_s,
            what="torch.compile of the reference",
        )
    except (RunnerTimeout, RunnerCrashed) as exc:
        why = f"torch.compile of the reference lost its runner: {exc}"
        baseline_lost[lost_key] = why
        log.warning("compile_baseline_lost", task=task.name, error=why)
        raise BaselineLost(why) from exc
    except RunnerFailed as exc:
        return BaselineCompiled(error=f"torch.compile of the reference failed: {exc}")
    if reply.error:
        log.info("compile_baseline_failed", task=task.name, error=reply.error)
    else:
        ref.baselines.add(session.cond.compile_mode)
        if not reply.cached:
            log.info("compile_baseline_compiled", task=task.name, seconds=reply.compile_s)
    return reply


def has_baseline(session: GradingSession) -> Callable[[RunnerHandle], bool]:
    """Whether an idle reference runner compiled the baseline in the session's mode (a
    preference for :meth:`RunnerPool.reference_lease`)."""
    mode = session.cond.compile_mode
    return lambda handle: mode in handle.baselines


def holds_no_baseline(handle: RunnerHandle) -> bool:
    """Whether a reference runner compiled no baseline (a preference for the stages that
    leave the runners holding one to the profiles: :meth:`RunnerPool.reference_lease`)."""
    return not handle.baselines


def compile_early(session: GradingSession) -> BaselineCompiled | None:
    """Compile the task's ``torch.compile`` baseline in a reference runner before the
    profile's turn: the compile is host work, minutes of it over a run's tasks, and the
    profile's exclusive hold of the device need not wait on it.

    The caller holds the device gate's shared side, as verifications do, so no timing
    runs meanwhile; the profile then leases that runner (:func:`has_baseline`) and finds
    the baseline compiled for the same inputs (``cached``). None where the run wants no
    baseline or this early compile could not be made: the profile then compiles as it
    always did, and reports any failure itself.
    """
    if not session.cond.compile_baseline:
        return None
    stage = Stage(session)
    try:
        with stage.reference_lease(trimmed=True, prefer=has_baseline(session)) as ref:
            stage.setup_reference()
            stage.load_task()
            stage.reference(MakeInputs(seed=session.seed, send=False))
            return compile_reference(session, ref, True)
    except Exception as exc:  # the profile does it all again and reports what fails
        log.info("compile_baseline_early_failed", task=session.task.name, error=str(exc))
        return None
