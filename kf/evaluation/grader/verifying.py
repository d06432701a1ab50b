"""The verify stage: trials on the task's inputs, the generalisation gate's shapes,
the hidden input distributions; and the re-verification of a speed-up above 10×.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import msgspec

from kf.evaluation.grader.admission import BIG_LOCKS, set_footprint, too_large
from kf.evaluation.grader.baseline import holds_no_baseline
from kf.evaluation.grader.baseline_settings import Conditions
from kf.evaluation.grader.grading import (
    DISTRIBUTION_FAILED,
    REVERIFY_ABOVE,
    CandidateFailed,
    log,
    seed_trials,
    trial_evidence,
    trim_reference,
)
from kf.evaluation.grader.sandbox import Limits, RunnerHandle, RunnerPool
from kf.evaluation.grader.session import GradingSession, Stage
from kf.evaluation.wire.protocol import MakeInputs, Run, UserTests
from kf.evaluation.wire.tolerance import Tolerance, for_dtype, resolve, rule_of
from kf.kernels.tasks import Task
from kf.reports import ProfileReport, TrialEvidence, VerifyReport

#: the most of a task's own get_extra_inputs() sets the generalisation gate runs
MAX_EXTRA_SETS = 32
#: the failure kind of a candidate that fails a task package's user test
USER_TEST_FAILED = "user_test_failed"


def verify_candidate(
    task: Task,
    source: str,
    *,
    device: str = "cpu",
    seed: int = 0,
    trials: int = 5,
    timeout_s: float = 120.0,
    limits: Limits | None = None,
    pool: RunnerPool | None = None,
    generalise: bool = True,
    tolerance: Tolerance | None = None,
    conditions: Conditions | None = None,
) -> VerifyReport:
    """Check the candidate against the reference on ``trials`` fresh seeded inputs (KernelBench).

    The first trial records the PyTorch ops ``forward`` dispatches (flag
    ``torch_compute``). With ``generalise``, the candidate is then checked on input
    shapes it never saw (the task's ``get_extra_inputs()``, else a rescaled leading
    dimension): the generalisation gate; failing it is ``generalisation_failed``.
    Raises :class:`TaskError` when the task itself is broken.
    """
    session = GradingSession(
        task, source, device=device, seed=seed, pool=pool, limits=limits or Limits(),
        timeout_s=timeout_s, tolerance=tolerance, conditions=conditions,
    )  # fmt: skip
    return verify_session(session, trials=trials, generalise=generalise)


def verify_session(
    session: GradingSession, *, trials: int = 5, generalise: bool = True
) -> VerifyReport:
    """:func:`verify_candidate` of the session's candidate."""
    stage = Stage(session)
    return stage.sandboxed(_verify(stage, trials, generalise))


def _verify(stage: Stage, trials: int, generalise: bool) -> VerifyReport:
    """:func:`verify_session` in ``stage``."""
    task = stage.task
    chosen, chosen_from = resolve(stage.session.tolerance, task.source)
    # a reference runner that compiled the task's baseline is left for the profiles
    with (
        stage.reference_lease(prefer=holds_no_baseline) as ref,
        stage.candidate_lease() as cand,
    ):
        found = _Findings(stage, cand, chosen, chosen_from)
        stage.restart_clock()
        try:
            stage.load_pair()
            failed = _seeded_trials(stage, found, trials)
            if failed is None and generalise:
                failed = _unseen_inputs(stage, found)
            if failed is None and task.tests:
                failed = _user_tests(stage, found)
            if failed is not None:
                return failed
            stage.keep_candidate()  # for the candidate's profile
        except CandidateFailed as exc:
            stage.after_candidate_failure(exc)
            detail = (
                f"\n{exc.log[-1500:]}" if exc.kind in ("crash", "exception") and exc.log else ""
            )
            return found.rejected(exc.kind, exc.error + detail)
        finally:
            trim_reference(ref)
            if found.big is not None:
                found.big.release()
    log.info("candidate_verified", task=task.name, trials=len(found.evidence))
    return found.report(correct=True)


class _Findings:
    """What a verification found so far (each trial's evidence, the gate's and the hidden
    distributions', flags, the widest tolerance applied), and its report at any point."""

    def __init__(
        self, stage: Stage, cand: RunnerHandle, chosen: Tolerance, chosen_from: str
    ) -> None:
        self.stage, self.cand, self.chosen, self.chosen_from = stage, cand, chosen, chosen_from
        self.start = time.monotonic()
        self.evidence: list[TrialEvidence] = []
        self.variants: list[TrialEvidence] = []
        self.hidden: list[TrialEvidence] = []
        self.flags: list[str] = []
        self.atol = self.rtol = 0.0
        self.big: threading.Lock | None = None  # held while a big task verifies

    def report(self, **kw: Any) -> VerifyReport:
        evidence, stage = self.evidence, self.stage
        return VerifyReport(
            trials=len(evidence),
            max_abs_err=max((e.max_abs_err for e in evidence), default=0.0),
            max_rel_err=max((e.max_rel_err for e in evidence), default=0.0),
            evidence=tuple(evidence),
            atol=self.atol,
            rtol=self.rtol,
            min_tolerance=max((e.min_tol for e in evidence), default=0.0),
            tolerance_source=self.chosen_from,
            duration_s=time.monotonic() - self.start,
            variant_evidence=tuple(self.variants),
            distribution_evidence=tuple(self.hidden),
            flags=tuple(self.flags) + tuple(f for f in self.cand.findings if f not in self.flags),
            phases=stage.phases(),
            peak_device_mb=stage.peak_device_mb(),
            rule=rule_of(self.chosen),
            float64_passed=sum(
                e.ok and e.rule == "float64" for e in (*evidence, *self.variants, *self.hidden)
            ),
            **kw,
        )

    def rejected(self, kind: str | None, error: str) -> VerifyReport:
        log.info("candidate_rejected", task=self.stage.task.name, kind=kind)
        return self.report(correct=False, failure_kind=kind, error=error)


def _seeded_trials(stage: Stage, found: _Findings, trials: int) -> VerifyReport | None:
    """The trials on the task's own inputs, one seed each (the first records the PyTorch
    ops ``forward`` dispatches); the report of the first that fails, else None."""
    device, chosen = stage.device, found.chosen
    for i, trial_seed in enumerate(seed_trials(stage.session.seed, trials)):
        made = stage.make_inputs(trial_seed)
        refused = too_large(made, device) if i == 0 else None
        if refused is not None:
            return found.rejected("too_large", refused)
        if (
            found.big is None
            and device.startswith("cuda")
            # $KF_BIG_TASK_MB (2048): two of KernelBench's 6 GB tasks side by side, each
            # with a reference and a candidate process, do not fit in an H200
            and set_footprint(made) > stage.session.grader.big_task_bytes
        ):
            found.big = BIG_LOCKS.setdefault(device, threading.Lock())
            found.big.acquire()
        pairs = [for_dtype(chosen, d) for d in made.output_dtypes]
        found.atol = max((a for a, _ in pairs), default=for_dtype(chosen, "float32")[0])
        found.rtol = max((r for _, r in pairs), default=for_dtype(chosen, "float32")[1])
        ran = stage.candidate(
            stage.run_request(made, trial_seed, trace=i == 0),
            what=f"forward (trial {i + 1})",
        )
        if ran.torch_ops:
            ops = ", ".join(f"aten.{op}" for op in ran.torch_ops[:8])
            found.flags.append(f"torch_compute: forward dispatched PyTorch ops {ops}")
        verdict = stage.judge(ran, trial_seed)
        found.evidence.append(trial_evidence(trial_seed, verdict))
        if not verdict.ok:
            why = f"trial {i + 1}/{trials} (seed {trial_seed}): {verdict.reason}"
            return found.rejected(verdict.kind, why)
    return None


def _unseen_inputs(stage: Stage, found: _Findings) -> VerifyReport | None:
    """The generalisation gate's shapes, then the hidden distributions; the report of the
    first that fails, else None."""
    failed = _generalisation_gate(stage, found.variants)
    if failed is not None:
        return found.rejected("generalisation_failed", failed)
    failed = _hidden_distributions(stage, found.hidden)
    if failed is not None:
        return found.rejected(DISTRIBUTION_FAILED, failed)
    return None


def _user_tests(stage: Stage, found: _Findings) -> VerifyReport | None:
    """A task package's user tests against the candidate, in its box
    (:mod:`kf.evaluation.runner.user_tests`); the report of the first that fails, else
    None."""
    tests = [(t.name, t.source) for t in stage.task.tests]
    ran = stage.candidate(UserTests(tests=tests, seed=stage.session.seed), what="user tests")
    if ran.failed:
        found.flags.append(f"user_tests: {len(ran.passed)} passed, {ran.failed} failed")
        return found.rejected(USER_TEST_FAILED, f"user test {ran.failed} failed: {ran.message}")
    found.flags.append(f"user_tests: {len(ran.passed)} passed")
    return None


def _hidden_distributions(stage: Stage, evidence: list[TrialEvidence]) -> str | None:
    """Run the candidate on the task's inputs scaled by each of
    :data:`kf.evaluation.grader.grading.SCALES` (never seen before); None, or why it failed.

    A distribution the reference rejects, or a task with no floating-point input, is
    skipped."""
    from kf.evaluation.grader.grading import SCALES

    seeds = seed_trials(stage.session.seed ^ 0xD157, len(SCALES))
    for scale, trial_seed in zip(SCALES, seeds, strict=True):
        made = stage.make_inputs(trial_seed, scale)
        if made.missing:  # the reference rejects them
            continue
        label = f"inputs ×{scale:g}"
        run = stage.run_request(made, trial_seed, scale)
        failed = _unseen_trial(stage, evidence, trial_seed, label, run, "hidden inputs")
        if failed is not None:
            return failed
    return None


def _unseen_trial(
    stage: Stage, evidence: list[TrialEvidence], trial_seed: int, label: str, run: Run, check: str
) -> str | None:
    """One trial on inputs the candidate never saw (``run``), judged by the reference
    and added to ``evidence``; None, or why ``check`` failed."""
    try:
        ran = stage.candidate(run, what=f"forward on {label}")
    except CandidateFailed as exc:
        stage.after_candidate_failure(exc)
        evidence.append(TrialEvidence(seed=trial_seed, ok=False, reason=exc.error, label=label))
        return f"{check}, {label} (never seen before): {exc.kind}: {exc.error}"
    verdict = stage.judge(ran, trial_seed)
    evidence.append(trial_evidence(trial_seed, verdict, label))
    if not verdict.ok:
        return f"{check}, {label} (never seen before): {verdict.kind}: {verdict.reason}"
    return None


def _generalisation_gate(stage: Stage, evidence: list[TrialEvidence]) -> str | None:
    """Run the candidate on input shapes it never saw; None, or why it failed. A task's
    own ``get_extra_inputs()`` are all run (up to :data:`MAX_EXTRA_SETS`: a robust-kbench
    folder's configurations, a package's swept shapes); derived shapes, four."""
    own = "def get_extra_inputs" in stage.task.source
    count = MAX_EXTRA_SETS if own else 4
    for variant, trial_seed in enumerate(seed_trials(stage.session.seed ^ 0x6E4E, count)):
        made = stage.reference(MakeInputs(seed=trial_seed, variant=variant))
        if made.missing or made.inputs is None:
            break
        run = Run(inputs=made.inputs)  # the reference chose the shapes: they travel
        gate = "generalisation gate"
        failed = _unseen_trial(stage, evidence, trial_seed, made.variant, run, gate)
        if failed is not None:
            return failed
    return None


def reverify_fast(
    task: Task,
    source: str,
    report: ProfileReport,
    *,
    device: str = "cpu",
    seed: int = 0,
    timeout_s: float = 120.0,
    pool: RunnerPool | None = None,
    tolerance: Tolerance | None = None,
    conditions: Conditions | None = None,
) -> ProfileReport:
    """Re-verify a speed-up above :data:`REVERIFY_ABOVE` on fresh seeds and shapes, and flag it.

    The profile is returned unchanged below the threshold; above it, it carries the
    re-verification and a ``speedup_over_10x`` flag, and fails (``reverify_failed``)
    when the re-verification does.
    """
    session = GradingSession(
        task, source, device=device, seed=seed, pool=pool, timeout_s=timeout_s,
        tolerance=tolerance, conditions=conditions,
    )  # fmt: skip
    return reverify_session(session, report)


def reverify_session(session: GradingSession, report: ProfileReport) -> ProfileReport:
    """:func:`reverify_fast` of the session's candidate: on the seed after the session's,
    with the runners' default limits."""
    if not report.ok or report.speedup <= REVERIFY_ABOVE:
        return report
    # in a fresh runner: a second look at a large claim shares no process with the first
    fresh = dataclasses.replace(session, seed=session.seed + 1, limits=Limits(), candidate_key=None)
    again = verify_session(fresh)
    task = session.task
    note = (
        f"speedup_over_10x: {report.speedup:.1f}× re-verified on {again.trials} fresh inputs "
        f"and {len(again.variant_evidence)} unseen shapes: "
        + ("passed" if again.correct else f"FAILED ({again.failure_kind})")
    )
    log.info("candidate_reverified", task=task.name, speedup=report.speedup, ok=again.correct)
    if again.correct:
        return msgspec.structs.replace(report, flags=(*report.flags, note), reverify=again)
    return msgspec.structs.replace(
        report,
        ok=False,
        failure_kind="reverify_failed",
        error=f"a {report.speedup:.1f}× speed-up did not survive re-verification: {again.error}",
        flags=(*report.flags, note),
        reverify=again,
    )
