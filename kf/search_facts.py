"""The kernel-search facts: candidates proposed, compiled, verified, profiled; parents
selected and elites admitted by the archive; tasks that could not be searched.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kf.events import Decision, Observation, Record, event
from kf.kernels.tasks import TaskInfo
from kf.reports import CompileReport, CountersReport, ProfileReport, TaskAudit, VerifyReport

__all__ = [
    "CandidateAssigned",
    "CandidateCompiled",
    "CandidateConfirmed",
    "CandidateDuplicate",
    "CandidateProfiled",
    "CandidateProposed",
    "CandidateRejected",
    "CandidateUnroutable",
    "CandidateVerified",
    "ConfirmationRequested",
    "CountersMeasured",
    "EliteAdmitted",
    "GeneralisationFailed",
    "Lesson",
    "LessonCompared",
    "LessonLearned",
    "LessonRetired",
    "LessonVerified",
    "LessonsLoaded",
    "MutationFailed",
    "ParentSelected",
    "StageReported",
    "TaskAudited",
    "TaskChecked",
    "TaskChecks",
    "TaskSkipped",
    "TunedChosen",
    "TuningRequested",
]


@event("kernel.candidate_proposed")
class CandidateProposed(Observation, frozen=True, kw_only=True):
    """A mutator (offline or LLM) proposed a candidate kernel module for a task."""

    candidate_id: str
    task: str
    source: str
    operator: str  # seed | mutate | crossover | rewrite | diff
    mutator: str  # who made it, honestly: "offline: …" or "llm: <model>"
    island: int = 0
    selection: int | None = None  # the ParentSelected.selection this answers (None: a seed)
    parent_id: str | None = None
    second_parent_id: str | None = None
    backend: str = "cpp-openmp"
    device: str = "cpu"
    family: str = ""
    config: dict[str, Any] = {}
    note: str = ""
    # a tuned candidate (operator "tune"): the tuning shape set it is evaluated at (0: the
    # task's own ``get_inputs()``; i: ``get_tuning_inputs()[i - 1]``), those shapes, and the
    # device whose tuner chose its configuration (it is evaluated there)
    shape_index: int = 0
    shape: str = ""
    tuned_on: str = ""
    # issue 48: which arm of a controlled comparison it answers ("lessons": its prompt
    # quoted ``lessons``; "control": the same parent, prompt and model without them)
    arm: str = ""
    lessons: tuple[str, ...] = ()


@event("kernel.mutation_failed")
class MutationFailed(Observation, frozen=True, kw_only=True):
    """A mutator could not produce a candidate for a selection (the reason says why)."""

    task: str
    selection: int
    reason: str
    mutator: str = ""
    arm: str = ""  # the arm of a controlled comparison it failed (issue 48; "": none)


class StageReported(Observation, frozen=True, kw_only=True):
    """What a device's stage (compiler, verifier, profiler) says of one assignment of a
    candidate; each stage's event adds its ``report``. Not an event itself."""

    candidate_id: str
    task: str
    device_id: str
    attempt: int = 1  # which assignment of the candidate this answers


@event("kernel.candidate_compiled")
class CandidateCompiled(StageReported, frozen=True, kw_only=True):
    """A compiler built (or failed to build) a candidate; the report holds its output."""

    report: CompileReport


@event("kernel.candidate_verified")
class CandidateVerified(StageReported, frozen=True, kw_only=True):
    """A verifier found a candidate's outputs equal to the reference on every trial."""

    report: VerifyReport


@event("kernel.candidate_rejected")
class CandidateRejected(StageReported, frozen=True, kw_only=True):
    """A verifier found a candidate wrong (or crashing, hanging, cheating); evidence attached."""

    report: VerifyReport


@event("kernel.candidate_profiled")
class CandidateProfiled(StageReported, frozen=True, kw_only=True):
    """A profiler timed a verified candidate and PyTorch eager on the same device."""

    report: ProfileReport


@event("kernel.counters_measured")
class CountersMeasured(Observation, frozen=True, kw_only=True):
    """Hardware counters (Nsight Compute) of a profiled candidate's kernels, or why none."""

    candidate_id: str
    task: str
    device_id: str
    report: CountersReport


@event("search.candidate_assigned")
class CandidateAssigned(Decision, frozen=True, kw_only=True):
    """The archive routed a candidate to a live device whose capabilities match it."""

    candidate_id: str
    task: str
    device_id: str
    attempt: int
    backend: str = ""  # the backend the archive derived from the candidate's source


@event("search.candidate_unroutable")
class CandidateUnroutable(Decision, frozen=True, kw_only=True):
    """No live device can run a candidate (its backend or device kind): it ends here, failed."""

    candidate_id: str
    task: str
    backend: str
    reason: str


@event("search.candidate_duplicate")
class CandidateDuplicate(Decision, frozen=True, kw_only=True):
    """The archive found a proposed candidate's source the same as an earlier candidate's
    of its task once comments and spacing are set aside (:mod:`kf.kernels.normal_form`),
    with the same configuration, shape set and device: it is not built, verified or timed
    again, and takes no part in the search (search version 5)."""

    candidate_id: str
    task: str
    duplicate_of: str
    digest: str = ""  # kf.kernels.normal_form.digest of both sources
    duplicate_status: str = ""  # what had become of duplicate_of when this was proposed


@event("kernel.generalisation_failed")
class GeneralisationFailed(Observation, frozen=True, kw_only=True):
    """A candidate failed on input shapes (or seeds) it was never evaluated on, so it
    cannot be reported as best; the reason names the shapes and what went wrong."""

    candidate_id: str
    task: str
    device_id: str
    reason: str
    stage: str = "verify"  # verify (the gate) | reverify (a speed-up above 10x)


@event("kernel.task_audited")
class TaskAudited(Observation, frozen=True, kw_only=True):
    """A task's reference was run on several input sets to see whether its outputs depend
    on its inputs; a degenerate task's speed-ups mean nothing (a constant passes it)."""

    task: str
    device_id: str
    audit: TaskAudit


@event("kernel.task_checked")
class TaskChecked(Observation, frozen=True, kw_only=True):
    """A task's reference was loaded and run once in a sandboxed runner before the run
    searched it (``kf run``'s task check): it gave outputs (``info``: shapes, dtypes,
    eager time), or it failed (``error``, one line) and the task was left out of the run."""

    task: str
    sha256: str  # the source that was checked
    device: str  # where it ran (cpu, cuda:0): a run's device, not a worker's device id
    ok: bool
    info: TaskInfo | None = None
    error: str = ""
    path: str | None = None
    duration_s: float = 0.0


class TaskChecks:
    """The task checks a log records, by task: the last of each (a projection for
    :func:`kf.fold.fold`)."""

    def initial_state(self) -> dict[str, TaskChecked]:
        """No task checked yet."""
        return {}

    def listens_to(self, tag: str) -> bool:
        """Only ``kernel.task_checked``."""
        return tag == TaskChecked.tag

    def evolve(self, state: dict[str, TaskChecked], rec: Record) -> dict[str, TaskChecked]:
        """The check replaces any earlier one of its task."""
        if isinstance(rec.event, TaskChecked):
            state[rec.event.task] = rec.event
        return state


@event("search.parent_selected")
class ParentSelected(Decision, frozen=True, kw_only=True):
    """The archive chose a parent (and operator) for the next candidate of a task.

    ``operator == "init"`` asks for a first-generation candidate written from the task's
    reference alone (``parent_id`` is then empty); ``evidence`` names earlier failed
    first-generation candidates whose failures the new prompt shows.
    """

    task: str
    selection: int  # 0-based count of selections for this task
    island: int
    operator: str  # init | mutate | crossover
    parent_id: str
    second_parent_id: str | None = None
    rng_seed: int = 0  # the mutator seeds its own choices with this
    language: str = ""  # cuda | triton | cpp: the kernel language asked for ("": any)
    evidence: tuple[str, ...] = ()  # failed candidates whose evidence the prompt carries


@event("search.elite_admitted")
class EliteAdmitted(Decision, frozen=True, kw_only=True):
    """A profiled candidate became the elite of its behavioural cell on an island."""

    task: str
    candidate_id: str
    island: int
    cell: tuple[int, int, int]
    speedup: float
    replaced: str | None = None
    migrated_from: int | None = None


@event("search.confirmation_requested")
class ConfirmationRequested(Decision, frozen=True, kw_only=True):
    """A device the run does not trust reported a result that would enter the archive
    (an elite, or a speed-up above the run's bound): another device measures the
    candidate again (compile, verify, profile) before it does (docs/authorization.md)."""

    task: str
    candidate_id: str
    claimed_by: str
    claimed_speedup: float
    reason: str


@event("search.candidate_confirmed")
class CandidateConfirmed(Decision, frozen=True, kw_only=True):
    """The outcome of a confirmation: another device's measurement (``confirmed_by``;
    ``""`` when no other device could measure it), and whether the claim stands (it is at
    most twice that measurement). The candidate enters the archive by the lower of the
    two speed-ups; one nobody else could measure never enters it."""

    task: str
    candidate_id: str
    claimed_by: str
    claimed_speedup: float
    confirmed_by: str
    measured_speedup: float | None = None
    accepted: bool = False
    reason: str = ""


@event("search.task_skipped")
class TaskSkipped(Decision, frozen=True, kw_only=True):
    """A task cannot be searched in this run (for example: no seed kernel and no LLM)."""

    task: str
    reason: str


@event("search.tuning_requested")
class TuningRequested(Decision, frozen=True, kw_only=True):
    """The archive asked a device's tuner to tune a kernel's template parameters per input
    shape, once the task's search budget is spent: its best kernel (search version 3), or
    each of its elites in turn, best first, with what the task has left (version 4)."""

    task: str
    candidate_id: str
    device_id: str
    budget: int  # configurations to time, over all shape sets together


@event("search.tuned_chosen")
class TunedChosen(Decision, frozen=True, kw_only=True):
    """The archive made a tuner's best configuration for one shape set and device a
    candidate; the mutator proposes it (operator ``tune``) and it is evaluated like any
    other, at that shape set, on that device."""

    task: str
    parent_id: str
    device_id: str
    shape_index: int
    shape: str
    config: dict[str, Any]
    baseline_ms: float | None = None  # the tuner's times at that shape: the parent's config
    best_ms: float | None = None  # and this one


class Lesson(msgspec.Struct, frozen=True, kw_only=True):
    """What one step of a search taught: what changed between a parent and its child, the
    diagnosis before and after, where (task features, device), what it bought (gain over
    the parent and the timing noise) and the candidates it came from. ``status`` is
    ``unverified`` until controlled comparisons show a gain beyond the noise, ``verified``
    then, ``retired`` once it stops paying (agents/lessons.py states the rules). The counts
    are those of every run that wrote the library back (``kf run --lessons``)."""

    lesson_id: str
    kind: str  # improvement | failure
    task: str
    text: str  # one short paragraph, quoted to models as data
    technique: str = ""  # the operator and the configuration change, if any
    cell_before: tuple[int, int, int] | None = None
    cell_after: tuple[int, int, int] | None = None
    diff_summary: str = ""
    diagnosis_before: str = ""  # ok | a failure class
    diagnosis_after: str = ""
    features: tuple[str, ...] = ()  # the task's features (torch ops, language)
    device: str = ""
    gain: float | None = None  # child speed-up / parent speed-up
    noise: float | None = None  # relative standard deviation of that ratio
    parent_id: str = ""
    child_id: str = ""
    run_id: str = ""
    status: str = "unverified"  # unverified | verified | retired
    uses: int = 0  # prompts that quoted it
    comparisons: int = 0  # controlled comparisons (with and without it) judged
    wins: int = 0  # of those, the ones where the arm with it gained beyond the noise
    dry: int = 0  # comparisons since its last win
    timed: int = 0  # comparisons where both arms were timed correct
    gain_sum: float = 0.0  # the sum of their gains (with / without): ``bought`` is the mean
    counted_runs: tuple[str, ...] = ()  # the runs whose counts these are (the last 64)

    @property
    def bought(self) -> float | None:
        """The mean gain of the arm with the lesson over the arm without, where both were
        timed (None: never)."""
        return self.gain_sum / self.timed if self.timed else None


@event("lesson.learned")
class LessonLearned(Decision, frozen=True, kw_only=True):
    """The archive derived a lesson: a child beat its profiled parent by more than the
    timing noise, or failed where its parent passed (search version 6)."""

    lesson: Lesson


@event("lesson.loaded")
class LessonsLoaded(Observation, frozen=True, kw_only=True):
    """The lessons a run read from its library when it started (``kf run --lessons``),
    bounded and cleaned, and one line for each entry refused; prompts quote them from here,
    so replay needs no library."""

    path: str
    lessons: tuple[Lesson, ...] = ()
    refused: tuple[str, ...] = ()


@event("lesson.compared")
class LessonCompared(Decision, frozen=True, kw_only=True):
    """The archive judged one controlled comparison (issue 48): a selection's child written
    with ``lessons`` quoted against its control, the same parent, prompt and model without
    them. A score is the speed-up of a correct kernel (a duplicate scores as the candidate
    it repeats), 0 for a failed one or a mutation that produced none; ``outcome`` is
    ``gain`` when the arm with the lessons beat the control beyond the timing noise, ``loss``
    the other way round, ``none`` otherwise."""

    task: str
    selection: int
    lessons: tuple[str, ...]
    candidate_id: str  # the arm with the lessons ("": its mutation failed)
    control_id: str  # the control arm ("": its mutation failed)
    score: float
    control_score: float
    gain: float | None = None  # score / control_score, where both are correct
    noise: float | None = None  # the relative standard deviation of that ratio
    outcome: str = "none"  # gain | none | loss


@event("lesson.verified")
class LessonVerified(Decision, frozen=True, kw_only=True):
    """A lesson's controlled comparisons (its library's and this run's) showed it pays:
    at least one gain beyond the noise, in more than half of them."""

    lesson_id: str
    comparisons: int
    wins: int
    bought: float | None = None


@event("lesson.retired")
class LessonRetired(Decision, frozen=True, kw_only=True):
    """A lesson stopped paying: its last comparisons showed no gain (``reason`` says how
    many); prompts no longer quote it."""

    lesson_id: str
    comparisons: int
    wins: int
    reason: str
