"""Lessons the archive derives (search version 6): a pure function of its state, so replay
recomputes them. A child that beats its profiled parent by more than the timing noise
teaches an improvement; a child that fails where its parent was profiled teaches a
failure. Each is a :class:`~kf.search_facts.LessonLearned` decision (issue 48).

Trust (search version 7): a selection whose prompt quotes lessons is answered twice, with
them and without (the control arm: the same parent, prompt and model). Once both arms are
judged the archive decides the comparison (:class:`~kf.search_facts.LessonCompared`): a
gain when the arm with the lessons scored above the control by more than
``max(2 × noise, 5 %)`` (noise: the two timings' relative spreads, as the profiler measured
them, combined), or was correct where the control was not. Each lesson quoted counts the
comparison; a lesson is verified (:class:`~kf.search_facts.LessonVerified`) once it has a
gain in more than half of its comparisons (:func:`kf.llm.lessons.verifies`), retired
(:class:`~kf.search_facts.LessonRetired`) after :data:`RETIRE_AFTER` comparisons in a row
without one. Only ids and measurements are read, never a lesson's text.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from kf.events import Event, derived_id
from kf.kernels.backends import language_of
from kf.kernels.behaviour import describe
from kf.llm.lessons import task_features, verifies
from kf.llm_facts import PromptChosen
from kf.search_facts import (
    CandidateProposed,
    Lesson,
    LessonCompared,
    LessonLearned,
    LessonRetired,
    LessonsLoaded,
    LessonVerified,
    MutationFailed,
)

__all__ = [
    "MIN_GAIN",
    "RETIRE_AFTER",
    "Tally",
    "Trial",
    "Trust",
    "chosen",
    "counted",
    "failed",
    "learned",
    "loaded",
    "proposed",
    "settle",
]

#: the least gain over the parent a lesson needs, whatever the noise
MIN_GAIN = 0.05
#: controlled comparisons in a row without a gain that retire a lesson
RETIRE_AFTER = 3


def _diff_summary(before: str, after: str) -> str:
    """How many lines changed, and the first few changed lines."""
    lines = [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    added = sum(1 for line in lines if line.startswith("+"))
    shown = "; ".join(line.strip()[:100] for line in lines[:4])
    return f"+{added} -{len(lines) - added} lines: {shown}"[:600]


def _config_change(parent: Any, child: Any) -> str:
    keys = sorted(set(parent.config) | set(child.config))
    changed = [
        f"{k} {parent.config.get(k)}→{child.config.get(k)}"
        for k in keys
        if parent.config.get(k) != child.config.get(k)
    ]
    return ", ".join(changed)


def _noise(parent: Any, child: Any) -> float:
    """The relative standard deviation of child/parent from their timings' spreads."""
    total = 0.0
    for c in (parent, child):
        if c.runtime_ms and c.runtime_std_ms:
            total += (c.runtime_std_ms / c.runtime_ms) ** 2
    return math.sqrt(total)


def learned(state: Any, child: Any, plan: list[Event]) -> None:
    """Plan the lesson ``child`` teaches against its parent, if it teaches one."""
    parent = state.candidates.get(child.parent_id or "")
    if parent is None or parent.status != "profiled" or not parent.speedup:
        return
    change = _config_change(parent, child)
    technique = f"{child.operator}" + (f": {change}" if change else "")
    where = f"On {child.task} ({state.config.device})"
    if child.status == "profiled" and child.speedup and not child.suspect:
        gain = child.speedup / parent.speedup
        noise = _noise(parent, child)
        if gain <= 1.0 + max(2.0 * noise, MIN_GAIN):
            return
        kind = "improvement"
        text = (
            f"{where}, {technique} made the kernel {gain:.2f}x faster than its parent "
            f"({parent.speedup:.2f}x → {child.speedup:.2f}x over eager; noise {100 * noise:.0f}%)."
        )
    elif child.status == "failed" and child.failure:
        gain, noise, kind = None, None, "failure"
        error = (child.error or "").strip().splitlines()[:1]
        text = f"{where}, {technique} broke a working kernel: {child.failure}" + (
            f" ({error[0][:200]})" if error else ""
        )
    else:
        return
    t = state.tasks[child.task]
    lesson = Lesson(
        lesson_id=derived_id("lesson", state.run_id, parent.id, child.id),
        kind=kind,
        task=child.task,
        text=text,
        technique=technique,
        cell_before=parent.cell,
        cell_after=describe(child.source).cell(),
        diff_summary=_diff_summary(parent.source, child.source),
        diagnosis_before="ok",
        diagnosis_after="ok" if kind == "improvement" else (child.failure or ""),
        features=task_features(t.reference, language_of(child.backend)),
        device=state.config.device,
        gain=gain,
        noise=noise,
        parent_id=parent.id,
        child_id=child.id,
        run_id=state.run_id,
    )
    plan.append(LessonLearned(lesson=lesson))


class Tally(msgspec.Struct, kw_only=True):
    """A lesson's counts (:class:`~kf.search_facts.Lesson` has the same fields)."""

    status: str = "unverified"
    uses: int = 0
    comparisons: int = 0
    wins: int = 0
    dry: int = 0
    timed: int = 0
    gain_sum: float = 0.0

    @classmethod
    def of(cls, lesson: Lesson) -> Tally:
        """The counts ``lesson`` carries."""
        return cls(**{f: getattr(lesson, f) for f in cls.__struct_fields__})

    def count(self, outcome: str, gain: float | None) -> None:
        """One controlled comparison more."""
        self.comparisons += 1
        if outcome == "gain":
            self.wins, self.dry = self.wins + 1, 0
        else:
            self.dry += 1
        if gain is not None:
            self.timed += 1
            self.gain_sum += gain


class Trial(msgspec.Struct, kw_only=True):
    """One controlled comparison being run: the lessons quoted, and each arm's candidate
    (``""``: its mutation failed) once proposed."""

    lessons: tuple[str, ...] = ()
    arms: dict[str, str] = {}
    void: bool = False  # an arm failed after the model's budget ran out: not judged


class Trust(msgspec.Struct, kw_only=True):
    """The archive's part of issue 48's trust: open comparisons, and every lesson's counts
    (its library's, then this run's)."""

    trials: dict[str, Trial] = {}  # "task:selection" → open comparison
    tally: dict[str, Tally] = {}


def loaded(trust: Trust, ev: LessonsLoaded) -> None:
    """The run's library: each lesson's counts start from its own."""
    for x in ev.lessons:
        trust.tally[x.lesson_id] = Tally.of(x)


def chosen(trust: Trust, ev: PromptChosen) -> None:
    """A prompt quoting lessons (a use of each) opens a comparison."""
    if ev.arm == "lessons":
        for lesson_id in ev.lessons:
            trust.tally.setdefault(lesson_id, Tally()).uses += 1
        trust.trials[f"{ev.task}:{ev.selection}"] = Trial(lessons=ev.lessons)


def proposed(trust: Trust, ev: CandidateProposed) -> None:
    """An arm's candidate."""
    trial = trust.trials.get(f"{ev.task}:{ev.selection}")
    if trial is not None and ev.arm:
        trial.arms[ev.arm] = ev.candidate_id


def failed(trust: Trust, ev: MutationFailed, budget_spent: bool) -> None:
    """An arm whose mutation produced nothing: it scores 0, unless the model's budget
    had run out (then the comparison is void)."""
    trial = trust.trials.get(f"{ev.task}:{ev.selection}")
    if trial is not None and ev.arm:
        trial.arms[ev.arm] = ""
        trial.void = trial.void or budget_spent


_WAIT, _VOID = "wait", "void"


def _measured(state: Any, cid: str, unjudged: Callable[[Any], bool]) -> Any:
    """An arm's score and the candidate measured for it, :data:`_WAIT` while that is in
    flight, :data:`_VOID` where nothing judged its code (lost, unroutable) or its timing
    is suspect. A duplicate is measured by the candidate it repeats."""
    if not cid:
        return 0.0, None
    c = state.candidates.get(cid)
    seen: set[str] = set()
    while c is not None and c.status == "duplicate" and c.id not in seen:
        seen.add(c.id)
        c = state.candidates.get((c.failure or "").removeprefix("duplicate of "))
    if c is None:
        return _VOID
    if c.in_flight:
        return _WAIT
    if unjudged(c) or c.suspect:
        return _VOID
    return (c.speedup or 0.0) if c.status == "profiled" else 0.0, c


def _outcome(a: tuple[float, Any], b: tuple[float, Any]) -> tuple[str, float | None, float | None]:
    """``(outcome, gain, noise)`` of the arm with lessons ``a`` against the control ``b``."""
    (score, x), (control, y) = a, b
    if score > 0 and control > 0:
        same = x is y
        gain, noise = (1.0, 0.0) if same else (score / control, _noise(x, y))
        bar = 1.0 + max(2.0 * noise, MIN_GAIN)
        return ("gain" if gain > bar else "loss" if gain * bar < 1.0 else "none"), gain, noise
    return ("gain" if score > control else "loss" if control > score else "none"), None, None


def settle(state: Any, plan: list[Event], unjudged: Callable[[Any], bool]) -> None:
    """Judge every open comparison whose arms are both judged: plan its
    :class:`~kf.search_facts.LessonCompared`, count it for each lesson quoted, and plan
    any lesson it verifies or retires."""
    trust: Trust = state.trust
    for key in sorted(trust.trials):
        trial = trust.trials[key]
        if set(trial.arms) != {"lessons", "control"}:
            continue
        a = _measured(state, trial.arms["lessons"], unjudged)
        b = _measured(state, trial.arms["control"], unjudged)
        if _WAIT in (a, b):
            continue
        del trust.trials[key]
        if trial.void or _VOID in (a, b):
            continue
        outcome, gain, noise = _outcome(a, b)
        task, _, selection = key.rpartition(":")
        plan.append(
            LessonCompared(
                task=task,
                selection=int(selection),
                lessons=trial.lessons,
                candidate_id=trial.arms["lessons"],
                control_id=trial.arms["control"],
                score=a[0],
                control_score=b[0],
                gain=gain,
                noise=noise,
                outcome=outcome,
            )
        )
        for lesson_id in trial.lessons:
            _judge(trust.tally.setdefault(lesson_id, Tally()), lesson_id, outcome, gain, plan)


def _judge(t: Tally, lesson_id: str, outcome: str, gain: float | None, plan: list[Event]) -> None:
    t.count(outcome, gain)
    bought = t.gain_sum / t.timed if t.timed else None
    if t.status == "unverified" and verifies(t.comparisons, t.wins):
        t.status = "verified"
        plan.append(
            LessonVerified(
                lesson_id=lesson_id, comparisons=t.comparisons, wins=t.wins, bought=bought
            )
        )
    elif t.status != "retired" and t.dry >= RETIRE_AFTER:
        t.status = "retired"
        plan.append(
            LessonRetired(
                lesson_id=lesson_id,
                comparisons=t.comparisons,
                wins=t.wins,
                reason=f"{t.dry} controlled comparisons in a row without a gain",
            )
        )


def counted(lesson: Lesson, run_id: str, events: Iterable[Any]) -> Lesson:
    """``lesson`` with run ``run_id``'s decisions about it folded in (its uses, comparisons
    and status), as ``kf run --lessons`` writes it back to the library; once only (a
    resumed run's second write-back changes nothing)."""
    if run_id in lesson.counted_runs:
        return lesson
    t = Tally.of(lesson)
    for ev in events:
        if isinstance(ev, PromptChosen) and ev.arm == "lessons" and lesson.lesson_id in ev.lessons:
            t.uses += 1
        elif isinstance(ev, LessonCompared) and lesson.lesson_id in ev.lessons:
            t.count(ev.outcome, ev.gain)
        elif (
            isinstance(ev, (LessonVerified, LessonRetired))
            and ev.lesson_id == lesson.lesson_id
            and t.status != "retired"
        ):
            t.status = "verified" if isinstance(ev, LessonVerified) else "retired"
    if t == Tally.of(lesson):
        return lesson
    runs = (*lesson.counted_runs, run_id)[-64:]
    return msgspec.structs.replace(lesson, **msgspec.structs.asdict(t), counted_runs=runs)
